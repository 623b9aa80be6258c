#!/usr/bin/env bash
# Builds llama.cpp's OpenAI-compatible server, llama-server, the CPU peer that
# `python benchmarks/bench_server.py --compare --llama-server PATH` runs beside `paged-attention
# serve`. The sources are the llama.cpp that the llama-cpp-python 0.3.36 sdist vendors (fetched
# with pip, built with cmake for this CPU: GGML_NATIVE). Prints the binary's path last.
#
#   bash benchmarks/build_llama_server.sh [build dir]   (default /tmp/llama-server-build;
#                                                        about 20 minutes on 2 cores; JOBS=N)
set -euo pipefail
build_dir=${1:-/tmp/llama-server-build}
version=0.3.36
mkdir -p "$build_dir"
cd "$build_dir"
if [ ! -d "llama_cpp_python-$version" ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d .
  tar xzf "llama_cpp_python-$version.tar.gz"
fi
src="llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON > configure.log 2>&1 || { tail -20 configure.log >&2; exit 1; }
cmake --build build --target llama-server -j "${JOBS:-$(nproc)}" > build.log 2>&1 \
  || { tail -20 build.log >&2; exit 1; }
echo "$build_dir/build/bin/llama-server"
