"""EngineConfig / CacheConfig / SchedulerConfig: every field validated once, errors naming the
field, and Engine(model, **kwargs) the same engine as Engine(model, config)."""

import pytest
import test_engine

transformers = pytest.importorskip("transformers")

from paged_attention.engine import (  # noqa: E402
    CacheConfig,
    Engine,
    EngineConfig,
    SamplingParams,
    SchedulerConfig,
)
from paged_attention.engine.config import KVBudgetError  # noqa: E402
from paged_attention.engine.scheduler import Scheduler  # noqa: E402
from paged_attention.kv.block_manager import BlockManager  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry  # noqa: E402

model = test_engine.model  # the fixture: test_engine's tiny Llama


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        ({"num_blocks": 0}, ValueError, "num_blocks"),
        ({"num_blocks": 2.5}, TypeError, "num_blocks"),
        ({"num_blocks": True}, TypeError, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, ValueError, "block_size"),
        ({"num_blocks": 8, "num_host_blocks": -1}, ValueError, "num_host_blocks"),
        ({}, ValueError, "num_blocks or max_memory"),
        ({"num_blocks": 8, "max_memory": 2**20}, ValueError, "num_blocks or max_memory"),
        ({"max_memory": 1.5}, ValueError, "max_memory"),
        ({"max_memory": 0}, ValueError, "max_memory"),
        ({"num_blocks": 8, "kv_cache_dtype": "int3"}, ValueError, "kv_cache_dtype"),
        ({"num_blocks": 8, "k_scale": 1.0}, ValueError, "k_scale and v_scale"),
        ({"num_blocks": 8, "k_scale": -1.0, "v_scale": 1.0}, ValueError, "k_scale"),
        ({"num_blocks": 8, "enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching"),
    ],
)
def test_cache_config_errors_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
    ],
)
def test_scheduler_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        ({"compile": "yes"}, ValueError, "compile"),
        ({"cuda_graphs": 1}, TypeError, "cuda_graphs"),
        ({"eos_token_id": -1}, ValueError, "eos_token_id"),
        ({"eos_token_id": 2.0}, TypeError, "eos_token_id"),
        ({"cache": None}, TypeError, "cache"),
    ],
)
def test_engine_config_errors_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        EngineConfig(**{"cache": CacheConfig(num_blocks=8), **kwargs})


def test_from_kwargs_sorts_the_fields_and_refuses_unknown_names():
    config = EngineConfig.from_kwargs(
        num_blocks=32, block_size=8, max_num_seqs=4, compile=False, eos_token_id=[2, 3]
    )
    assert config == EngineConfig(
        CacheConfig(num_blocks=32, block_size=8),
        SchedulerConfig(max_num_seqs=4),
        eos_token_id=(2, 3),
    )
    with pytest.raises(TypeError, match="num_block"):
        EngineConfig.from_kwargs(num_block=32)
    with pytest.raises(TypeError, match="cache"):
        EngineConfig.from_kwargs(cache=CacheConfig(num_blocks=8))


def test_engine_kwargs_and_config_build_the_same_engine(model):
    kwargs = dict(num_blocks=24, block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    short = Engine(model, **kwargs)
    config = EngineConfig(
        CacheConfig(num_blocks=24, block_size=8),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )
    full = Engine(model, config)
    assert short.config == full.config == config
    assert short.block_manager.num_device_blocks == full.block_manager.num_device_blocks == 24
    assert short.scheduler.config is short.config.scheduler
    work = [[5, 6, 7, 8] * 5, [9, 10, 11]]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
    assert [o.outputs for o in short.generate(work, params)] == [
        o.outputs for o in full.generate(work, params)
    ]
    with pytest.raises(TypeError, match="not both"):
        Engine(model, config, num_blocks=24)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(model, {"num_blocks": 24})


def test_a_memory_budget_is_sized_from_the_model_geometry(model):
    cache = CacheConfig(block_size=8, max_memory=2**20)
    geometry = ModelGeometry.of(model)
    # 2 layers, keys and values, 2 KV heads of 32, 8 tokens, float32
    assert cache.block_bytes(geometry) == 2 * 2 * 2 * 32 * 8 * 4
    assert cache.sizes(geometry) == (2**20 // 8192, 0)  # no host copy on a CPU by default
    engine = Engine(model, EngineConfig(cache))
    assert engine.block_manager.num_device_blocks == 128
    with pytest.raises(ValueError, match="max_memory"):
        Engine(model, max_memory=100, block_size=8)  # holds no block


def test_blocks_beyond_the_memory_there_is_are_refused_before_allocating(model):
    with pytest.raises(KVBudgetError, match=r"num_blocks: 1000000000000 blocks of 8192 bytes"):
        Engine(model, num_blocks=10**12, block_size=8)


def test_the_scheduler_takes_a_validated_config():
    manager = BlockManager(8, 4)
    config = SchedulerConfig(max_num_seqs=3)
    assert Scheduler(manager, config).max_num_seqs == 3
    assert Scheduler(manager, max_num_seqs=5).config == SchedulerConfig(max_num_seqs=5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(manager, max_num_seqs=0)
    with pytest.raises(TypeError, match="not both"):
        Scheduler(manager, config, max_num_seqs=3)
