"""Structured output in the engine (paged_attention.engine.structured_output): on the tiny
random model, whose unconstrained output is byte noise, every constrained output must follow
its grammar, so these tests fail at once if a mask is missing, misplaced or stale."""

from __future__ import annotations

import json
import pickle
import re
from typing import Literal

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")
pydantic = pytest.importorskip("pydantic")

from paged_attention.engine import Engine, RequestError, SamplingParams  # noqa: E402
from paged_attention.engine.structured_output import (  # noqa: E402
    StructuredOutputParams,
    apply_grammars,
    mask_backend,
    tokenizer_info,
)
from paged_attention.modeling.tiny import tiny_chat_model  # noqa: E402


class Order(pydantic.BaseModel):
    """The schema the tests ask for: every kind of constraint a random model would break."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    paid: bool
    count: int = pydantic.Field(ge=0, le=99)
    colour: Literal["red", "green", "blue"]
    code: str = pydantic.Field(pattern=r"^[a-z]{1,6}$")
    tags: list[Literal["x", "y"]] = pydantic.Field(max_length=3)


SCHEMA = Order.model_json_schema()


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = tiny
    return Engine(model, tokenizer=tokenizer, num_blocks=256, block_size=16, max_num_seqs=16)


def constrained(kind: str = "json", max_new_tokens: int = 160, **params) -> SamplingParams:
    value = {"json": SCHEMA, "json_object": True}.get(kind)
    structured = params.pop("structured", None) or StructuredOutputParams(**{kind: value})
    return SamplingParams(max_new_tokens=max_new_tokens, structured_output=structured, **params)


def test_a_json_schema_is_met_by_every_sample_of_every_seed(engine):
    params = [constrained(temperature=1.0, seed=seed, n=3) for seed in range(4)]
    outputs = engine.generate(["Order:"] * 4, params)
    texts = [text for output in outputs for text in output.texts]
    for output in outputs:
        assert output.finish_reasons == ["eos"] * 3  # the grammar's end allowed only EOS
    for text in texts:
        Order.model_validate_json(text)
    assert len(set(texts)) > 1  # the samples have matchers of their own and differ


def test_greedy_structured_output_equals_a_reference_decoding_loop(tiny, engine):
    """Each token: the model's full forward pass, the matcher's mask applied to the logits
    one row at a time, argmax; the engine must choose the same tokens (the engine switched
    its model to paged attention: the reference is a second copy of the same weights)."""
    _, tokenizer = tiny
    model = tiny_chat_model()[0]
    prompt = tokenizer("An order, please: ")["input_ids"]
    (output,) = engine.generate([prompt], constrained())
    info = tokenizer_info(tokenizer, model.config.vocab_size)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=[tokenizer.eos_token_id])
    tokens = list(prompt)
    bitmask = xgrammar.allocate_token_bitmask(1, model.config.vocab_size)
    while not matcher.is_terminated():
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[:, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        tokens.append(token)
    assert output.outputs[0] == tokens[len(prompt) :]
    Order.model_validate_json(output.texts[0])


def test_json_object_gives_a_json_object(engine):
    # A bias towards '"' and '}' keeps the random model's keys and objects short (the grammar
    # still decides which tokens are allowed at all).
    bias = {ord('"'): 3.0, ord("}"): 3.0}
    params = [
        constrained("json_object", 300, temperature=1.0, seed=seed, logit_bias=bias)
        for seed in range(3)
    ]
    for output in engine.generate(["JSON:"] * 3, params):
        assert output.finish_reasons == ["eos"]
        assert isinstance(json.loads(output.texts[0]), dict)


CHOICES = ('say "hi"', "a\\b", "naïve", "two\nlines")


def test_an_ebnf_grammar_a_regex_and_a_choice(engine):
    grammar = StructuredOutputParams(grammar='root ::= ("yes" | "no") "!" [0-9]')
    regex = StructuredOutputParams(regex=r"[a-c]{3}-\d\d")
    choice = StructuredOutputParams(choice=list(CHOICES))
    params = [
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, structured_output=g)
        for g in (grammar, regex, choice)
        for s in range(3)
    ]
    outputs = engine.generate(["?"] * len(params), params)
    for output in outputs[:3]:
        assert re.fullmatch(r"(yes|no)![0-9]", output.texts[0])
    for output in outputs[3:6]:
        assert re.fullmatch(r"[a-c]{3}-\d\d", output.texts[0])
    for output in outputs[6:]:
        assert output.texts[0] in CHOICES and output.finish_reasons == ["eos"]


def test_a_constrained_request_leaves_the_others_of_its_batch_alone(engine):
    plain = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    (alone,) = engine.generate(["Hi"], plain)
    mixed = engine.generate(["Hi", "Order:", "Hi"], [plain, constrained(seed=1), plain])
    assert mixed[0].outputs == alone.outputs == mixed[2].outputs
    Order.model_validate_json(mixed[1].texts[0])


def test_an_invalid_grammar_is_refused_when_the_request_is_added(engine):
    bad_schema = StructuredOutputParams(json={"type": "object", "properties": {"a": 3}})
    for structured in (bad_schema, StructuredOutputParams(grammar="root ::= undefined_rule")):
        with pytest.raises(RequestError, match="structured_output") as caught:
            engine.add_request("hi", SamplingParams(structured_output=structured))
        assert caught.value.argument == "structured_output"
    assert not engine.has_unfinished()


def test_compiled_grammars_and_the_vocabulary_are_built_once(tiny, engine):
    model, tokenizer = tiny
    assert tokenizer_info(tokenizer, 259) is tokenizer_info(tokenizer, 259)
    engine.generate(["a"], constrained(max_new_tokens=2))
    compiler = engine.input_processor._grammar_compiler
    cached = compiler._compiler.get_cache_size_bytes()
    engine.generate(["b"], constrained(max_new_tokens=2))  # the same schema: from the cache
    assert compiler._compiler.get_cache_size_bytes() == cached
    engine.generate(["c"], constrained(max_new_tokens=2, structured=_other_schema()))
    assert compiler._compiler.get_cache_size_bytes() > cached


def _other_schema() -> StructuredOutputParams:
    return StructuredOutputParams(json={"type": "object", "properties": {"z": {"type": "null"}}})


def test_an_engine_without_a_tokenizer_refuses_structured_output(tiny):
    model, _ = tiny
    engine = Engine(model, num_blocks=32, block_size=16)
    with pytest.raises(RequestError, match="tokenizer") as caught:
        engine.add_request([1, 2, 3], constrained())
    assert caught.value.argument == "structured_output"


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({}, "exactly one of"),
        ({"json": SCHEMA, "regex": "a"}, "exactly one of"),
        ({"json": "{not json"}, r"structured_output\.json is not valid JSON"),
        ({"json": [1, 2]}, r"structured_output\.json must be a dict or bool"),
        ({"json_object": "yes"}, r"json_object must be True or False"),
        ({"grammar": ""}, r"structured_output\.grammar must be a non-empty string"),
        ({"structural_tag": 3}, r"structural_tag must be a dict"),
        ({"choice": "ab"}, r"choice must be a non-empty list of strings"),
        ({"choice": ["a", ""]}, r"choice entries must be non-empty strings"),
    ],
)
def test_structured_output_params_are_checked_when_built(arguments, match):
    with pytest.raises(RequestError, match=match) as caught:
        StructuredOutputParams(**arguments)
    assert caught.value.argument == "structured_output"


@pytest.mark.parametrize("arguments", [{"beam_width": 2}, {"min_tokens": 1}, {"ignore_eos": True}])
def test_controls_that_fight_the_grammars_end_are_refused(arguments):
    (name,) = arguments
    with pytest.raises(RequestError, match=f"{name} is not supported with structured_output"):
        SamplingParams(structured_output=StructuredOutputParams(json_object=True), **arguments)
    with pytest.raises(RequestError, match="structured_output must be StructuredOutputParams"):
        SamplingParams(structured_output={"json": {}})


def test_sampling_params_with_a_grammar_pickle_and_hash():
    params = constrained(seed=3)
    assert params.structured_output.json == json.dumps(SCHEMA, ensure_ascii=False)
    copy = pickle.loads(pickle.dumps(params))
    assert copy == params and hash(copy) == hash(params)


def test_the_batched_mask_equals_each_matchers_own(tiny):
    """apply_grammars on chosen rows of a batch, with xgrammar's CPU kernel and with its plain
    PyTorch one (the CUDA fallback without Triton), against each matcher's bitmask unpacked
    row by row in Python."""
    _, tokenizer = tiny
    info = tokenizer_info(tokenizer, 259)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(2)]
    assert matchers[1].accept_string('{"paid": t')
    logits = torch.randn(4, 259, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    for row, matcher in zip((1, 3), matchers):
        bitmask = xgrammar.allocate_token_bitmask(1, 259)
        matcher.fill_next_token_bitmask(bitmask)
        allowed = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(259)]
        expected[row, [t for t in range(259) if not allowed[t]]] = float("-inf")
    assert mask_backend(torch.device("cpu")) == "cpu"
    for backend in ("cpu", "torch_native"):
        masked = logits.clone()
        if backend == "cpu":
            apply_grammars(masked, [(1, matchers[0]), (3, matchers[1])])
        else:
            bitmask = xgrammar.allocate_token_bitmask(4, 259)
            for row, matcher in zip((1, 3), matchers):
                matcher.fill_next_token_bitmask(bitmask, row)
            xgrammar.apply_token_bitmask_inplace(masked, bitmask, indices=[1, 3], backend=backend)
        assert torch.equal(masked, expected)
    assert torch.isfinite(expected[1]).sum() == 1  # only '"' may follow '{'


def test_preemption_and_chunked_prefill_leave_the_matchers_right(tiny, engine):
    """A pool too small for the batch preempts requests (recomputed later) and prompts are
    prefilled in chunks: each matcher must still consume exactly its sequence's tokens, so the
    outputs equal those of the roomy engine."""
    model, tokenizer = tiny
    small = Engine(
        model,
        tokenizer=tokenizer,
        num_blocks=24,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    prompts = [f"Order number {i}: " for i in range(4)]
    params = [constrained(temperature=1.0, seed=seed, n=2) for seed in range(4)]
    expected = engine.generate(prompts, params)
    outputs = small.generate(prompts, params)
    assert small.stats.preemptions_by_recompute > 0
    assert [o.outputs for o in outputs] == [o.outputs for o in expected]
    for output in outputs:
        for text in output.texts:
            Order.model_validate_json(text)
