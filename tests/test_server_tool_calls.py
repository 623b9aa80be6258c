"""Reading Hermes tool calls out of a model's text (paged_attention.server.tool_calls), whole
and streamed in pieces, and the grammar that forces them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.server.tool_calls import ToolCallParser, tool_call_grammar

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'


def whole(text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, dict]]]:
    parser = ToolCallParser(parallel)
    parser.feed(text, final=True)
    return parser.content, [(c["function"]["name"], _arguments(c)) for c in parser.calls]


def _arguments(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("plain words", "plain words", []),
        ("text ending in <tool", "text ending in <tool", []),
        (CALL, None, [("get_weather", {"city": "Paris"})]),
        (f"Let me look.\n{CALL}", "Let me look.", [("get_weather", {"city": "Paris"})]),
        (
            f"{CALL}\n{OTHER}",
            None,
            [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, 3]})],
        ),
        # a malformed call is dropped; with no call at all, the text is the content
        (
            f"{CALL}\n<tool_call>\n{{broken\n</tool_call>",
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        ("<tool_call>\n{broken\n</tool_call>", "<tool_call>\n{broken\n</tool_call>", []),
        # cut at a length limit: the last call counts if its JSON is whole
        (CALL[: -len("ll>")], None, [("get_weather", {"city": "Paris"})]),
        (CALL[:30], CALL[:30], []),
        # arguments written as JSON text, and the "parameters" spelling
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            None,
            [("f", {"x": 1})],
        ),
        ('<tool_call>{"name": "f", "parameters": {"x": 2}}</tool_call>', None, [("f", {"x": 2})]),
    ],
)
def test_calls_and_content_of_a_whole_text(text, content, calls):
    assert whole(text) == (content, calls)


def test_parallel_false_keeps_the_first_call():
    assert whole(f"{CALL}\n{OTHER}", parallel=False) == (None, [("get_weather", {"city": "Paris"})])


def test_each_call_has_its_own_openai_shape():
    parser = ToolCallParser()
    parser.feed(f"{CALL}\n{CALL}", final=True)
    first, second = parser.calls
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["id"] != second["id"]
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


TEXTS = [
    "plain words <tool_ and more",
    f"Sure thing.  \n{CALL}\n{OTHER}",
    f"{CALL}\n<tool_call>\n{{broken\n</tool_call>\n{OTHER}",
    "<tool_call>\n{broken",
    CALL[:-3],
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_pieces_add_up_to_the_whole(text, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    parser = ToolCallParser()
    content, calls = "", []
    for start, stop in zip(bounds, bounds[1:]):
        piece, new = parser.feed(text[start:stop], final=stop == len(text))
        content += piece
        calls += [(c["function"]["name"], _arguments(c)) for c in new]
    if len(bounds) == 1:  # an empty text
        parser.feed("", final=True)
    expected_content, expected_calls = whole(text)
    assert (content or None if calls else content) == expected_content
    assert calls == expected_calls


def test_content_before_a_call_streams_without_the_tag():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool") == ("Hello", [])  # the blank and "<tool" held back
    assert parser.feed("box> there") == (" <toolbox> there", [])
    assert parser.feed(f"\n{CALL}", final=True)[0] == ""


def test_the_grammar_names_each_tool_and_its_parameters():
    parameters = {"type": "object", "properties": {"x": {"type": "integer"}}}
    grammar = tool_call_grammar([("f", parameters), ("g", None)], parallel=False)
    form = grammar["format"]
    assert form["type"] == "tags_with_separator"
    assert form["at_least_one"] and form["stop_after_first"]
    schemas = [tag["content"]["json_schema"] for tag in form["tags"]]
    assert [s["properties"]["name"] for s in schemas] == [{"const": "f"}, {"const": "g"}]
    assert schemas[0]["properties"]["arguments"] == parameters
    assert schemas[1]["properties"]["arguments"] == {"type": "object"}
    assert all(
        tag["begin"] == "<tool_call>\n" and tag["end"] == "\n</tool_call>" for tag in form["tags"]
    )
