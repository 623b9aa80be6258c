"""``response_format`` on the OpenAI-compatible server, through the official client: on the
tiny random model, whose unconstrained text is byte noise, an answer that parses and validates
is the grammar's doing."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from test_server import LiveServer, make_engine  # noqa: E402

from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import create_app  # noqa: E402


class Reading(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    sensor: Literal["north", "south"]
    value: int = pydantic.Field(ge=-40, le=60)
    ok: bool
    unit: str = pydantic.Field(pattern=r"^[A-Z]{1,3}$")


FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "reading", "schema": Reading.model_json_schema(), "strict": True},
}
MESSAGES = [{"role": "user", "content": "A reading, please."}]


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_model("tiny")
    live = LiveServer(create_app(make_engine(model, tokenizer), tokenizer, "tiny", max_n=4))
    yield live
    live.stop()


@pytest.mark.parametrize("seed", range(4))
def test_a_json_schema_answer_validates(served, seed):
    answer = served.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format=FORMAT,
        max_tokens=120,
        temperature=1.0,
        seed=seed,
        n=2,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        Reading.model_validate_json(choice.message.content)


def test_a_streamed_json_schema_answer_validates(served):
    stream = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=FORMAT, max_tokens=120, seed=9, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Reading.model_validate_json(text)


def test_json_object_gives_a_json_object(served):
    # The bias towards '"' and '}' keeps the random model's keys and objects short.
    bias = {str(ord('"')): 3, str(ord("}")): 3}
    for seed in range(2):
        answer = served.client().chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_object"},
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,
        )
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_completions_take_a_response_format_too(served):
    answer = served.client().completions.create(
        model="tiny",
        prompt="Reading:",
        max_tokens=120,
        seed=3,
        extra_body={"response_format": FORMAT},
    )
    Reading.model_validate_json(answer.choices[0].text)


@pytest.mark.parametrize(
    "fields, check",
    [
        (
            {"structured_outputs": {"choice": ["yes", "no", "it depends"]}},
            lambda t: t in ("yes", "no", "it depends"),
        ),
        (
            {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
            lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t),
        ),
        (
            {"structured_outputs": {"json": Reading.model_json_schema()}},
            Reading.model_validate_json,
        ),
        ({"guided_json": json.dumps(Reading.model_json_schema())}, Reading.model_validate_json),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9][0-9]", t)),
    ],
)
def test_vllms_structured_output_fields(served, fields, check):
    for seed in range(2):
        chat = served.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=120, seed=seed, extra_body=fields
        )
        completion = served.client().completions.create(
            model="tiny", prompt="?", max_tokens=120, seed=seed, extra_body=fields
        )
        for text in (chat.choices[0].message.content, completion.choices[0].text):
            assert check(text), text


def test_the_text_format_asks_for_nothing(served):
    answer = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "text"}, max_tokens=4, seed=1
    )
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "response_format",
            "could not be compiled",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "needs json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", None),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "give one structured output field",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "could not be compiled"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        (
            {"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}},
            "structured_outputs",
            "exactly one of",
        ),
        (
            {"response_format": {"type": "json_object"}, "min_tokens": 2},
            "min_tokens",
            "not supported with structured_output",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(served, fields, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, extra_body=fields
        )
    error = caught.value.body
    assert error["param"] == param
    if message:
        assert message in error["message"]
    assert "json_schema_converter" not in error["message"]  # no internal source locations
