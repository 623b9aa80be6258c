"""Reading tool calls out of a model's text (paged_attention.server.tool_calls): each format
whole and streamed in any pieces (the streamed deltas add up to the whole answer), the JSON
read a character at a time, the parser registry, and the grammar that forces calls in each
format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_attention.server.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PARSER_NAMES,
    CallFormat,
    ToolCallReader,
    call_format,
    stream_deltas,
    tool_call_grammar,
)
from paged_attention.server.tool_calls.json_scan import JsonValueScanner, Step
from paged_attention.server.tool_calls.reader import Arguments, CallStart, Content

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'
WEATHER = ("get_weather", '{"city": "Paris"}')
ADD = ("add", '{"a": 1, "b": [2, 3]}')
F1, FX = ("f", '{"a": 1}'), ("f", '{"x": 1}')


def whole(text: str, form=HERMES, parallel: bool = True):
    """``(content, [(name, arguments)])`` of ``text`` read at once."""
    reader = ToolCallReader(form, parallel)
    reader.feed(text, final=True)
    return reader.content, [
        (c["function"]["name"], c["function"]["arguments"]) for c in reader.calls
    ]


def streamed(pieces: list[str], form=HERMES, parallel: bool = True):
    """``(content, [(name, arguments)], deltas)`` of the chat chunks' deltas of ``pieces``
    (the last one final), put together as a client does."""
    reader = ToolCallReader(form, parallel)
    deltas = []
    for k, piece in enumerate(pieces):
        deltas += stream_deltas(reader.feed(piece, final=k == len(pieces) - 1))
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    found = [tuple(calls[i]) for i in sorted(calls)]
    return (content or None) if found else content, found, deltas


# ---------------------------------------------------------------------- Hermes


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("plain words", "plain words", []),
        ("text ending in <tool", "text ending in <tool", []),
        ("trailing blanks stay  \n", "trailing blanks stay  \n", []),
        (CALL, None, [WEATHER]),
        (f"Let me look.\n{CALL}", "Let me look.", [WEATHER]),
        (f"{CALL}\n{OTHER}", None, [WEATHER, ADD]),
        (f"{CALL}\nThat is all.\n", "That is all.\n", [WEATHER]),
        # a malformed call is content, as written; the reading goes on after it
        (
            f"{CALL}\n<tool_call>\n{{broken\n</tool_call>",
            "<tool_call>\n{broken\n</tool_call>",
            [WEATHER],
        ),
        ("<tool_call>\n{broken\n</tool_call>", "<tool_call>\n{broken\n</tool_call>", []),
        (f"<tool_call>{{}}</tool_call>{OTHER}", "<tool_call>{}</tool_call>", [ADD]),
        ('<tool_call>{"name": 7}</tool_call>', '<tool_call>{"name": 7}</tool_call>', []),
        ('<tool_call><tool_call>{"name": "f"}', "<tool_call>", [("f", "{}")]),
        # cut at a length limit: the call as far as it was written
        (CALL[: -len("ll>")], None, [WEATHER]),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"cit',
            None,
            [("get_weather", '{"cit')],
        ),
        (CALL[:30], CALL[:30], []),  # before the name is whole: text
        # a call whose JSON breaks after its name keeps what was written before the break
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}\n</tool_call>ok',
            "ok",
            [("f", '{"a": 1}')],
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1 2}}</tool_call>',
            "2}}</tool_call>",
            [("f", '{"a": 1 ')],
        ),
        # arguments as JSON text, the "parameters" spelling, none, or of no usable kind
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            None,
            [("f", '{"x": 1}')],
        ),
        ('<tool_call>{"name": "f", "parameters": {"x": 2}}</tool_call>', None, [("f", '{"x": 2}')]),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
        ('<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [("f", "{}")]),
        # other members are read over; the name may come last (the arguments wait for it)
        (
            '<tool_call>{"id": [{"x": "}"}], "arguments": {"k": -1.5e3}, "name": "f"}</tool_call>',
            None,
            [("f", '{"k": -1.5e3}')],
        ),
        # the arguments exactly as written (blanks, escapes, key order)
        (
            '<tool_call>{"name":"f","arguments":{ "b" :[ ],\n "a":"\\u00e9\\n" }}</tool_call>',
            None,
            [("f", '{ "b" :[ ],\n "a":"\\u00e9\\n" }')],
        ),
        ('<tool_call>{"name": "\\u00e9t\\u00e9"}</tool_call>', None, [("été", "{}")]),
    ],
)
def test_hermes_whole_texts(text, content, calls):
    assert whole(text) == (content, calls)


def test_parallel_false_keeps_the_first_call():
    assert whole(f"{CALL}\n{OTHER}", parallel=False) == (None, [WEATHER])
    content, calls, _ = streamed(list(f"{CALL}\n{OTHER}"), parallel=False)
    assert (content, calls) == (None, [WEATHER])


def test_each_call_has_its_own_openai_shape():
    reader = ToolCallReader(HERMES)
    reader.feed(f"{CALL}\n{CALL}", final=True)
    first, second = reader.calls
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["id"] != second["id"]
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_the_name_comes_as_soon_as_it_is_read_and_the_arguments_as_they_are_written():
    reader = ToolCallReader(HERMES)
    assert reader.feed("Hi <tool_call>\n") == [Content("Hi")]
    assert reader.feed('{"name": "get_wea') == []  # a name is sent whole
    start = reader.feed('ther", "arg')
    assert len(start) == 1 and isinstance(start[0], CallStart)
    assert (start[0].index, start[0].name) == (0, "get_weather")
    assert reader.feed('uments": {"ci') == [Arguments(0, '{"ci')]
    assert reader.feed('ty": 1') == [Arguments(0, 'ty": 1')]
    assert reader.feed("}") == [Arguments(0, "}")]
    assert reader.feed("}\n</tool_call>", final=True) == []


def test_the_first_delta_of_a_call_is_openai_s():
    _, _, deltas = streamed([CALL[:50], CALL[50:]])
    first, *rest = [d["tool_calls"][0] for d in deltas]
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["index"] == 0
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert rest and all(set(d) == {"index", "function"} and d["index"] == 0 for d in rest)
    assert all(set(d["function"]) == {"arguments"} for d in rest)


def test_content_before_a_call_streams_without_the_tag():
    reader = ToolCallReader(HERMES)
    assert reader.feed("Hello <tool") == [Content("Hello")]  # " <tool" held back
    assert reader.feed("box> there") == [Content(" <toolbox> there")]
    assert [type(e) for e in reader.feed(f"\n{CALL}", final=True)] == [CallStart, Arguments]


# ---------------------------------------------------------------------- Llama 3 JSON

LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_ADD = '{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (LLAMA, None, [WEATHER]),
        (f"  \n{LLAMA}", None, [WEATHER]),
        (f"<|python_tag|>{LLAMA}", None, [WEATHER]),
        (f"{LLAMA}; {LLAMA_ADD}", None, [WEATHER, ADD]),
        (f"<|python_tag|>{LLAMA};{LLAMA_ADD}", None, [WEATHER, ADD]),
        (f"Let me look.<|python_tag|>{LLAMA}", "Let me look.", [WEATHER]),
        # a JSON object later in the text, or without a name, is text
        (f"Here: {LLAMA}", f"Here: {LLAMA}", []),
        ('{"a": 1} is JSON', '{"a": 1} is JSON', []),
        ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
        (f"{LLAMA}; and more", "; and more", [WEATHER]),
        ('{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),
        ('{"type": "function", "name": "f", "parameters": {}}', None, [("f", "{}")]),
    ],
)
def test_llama3_json_whole_texts(text, content, calls):
    assert whole(text, LLAMA3_JSON) == (content, calls)


# ---------------------------------------------------------------------- Mistral

MISTRAL_CALLS = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}]'
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (MISTRAL_CALLS, None, [WEATHER, ADD]),
        (MISTRAL_CALLS.replace("][", "] ["), None, [WEATHER, ADD]),
        (f"Let me look. {MISTRAL_CALLS}", "Let me look.", [WEATHER, ADD]),
        (f"{MISTRAL_CALLS} Done.", "Done.", [WEATHER, ADD]),
        ('[TOOL_CALLS]{"name": "f"}', '[TOOL_CALLS]{"name": "f"}', []),  # no list
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        ("[TOOL_CALLS][{broken}]", "[TOOL_CALLS][{broken}]", []),
        ("a [link] here", "a [link] here", []),
        ('[TOOL_CALLS][{"name": "f", "parameters": {"x": 1}}]', None, [FX]),
        # the newer form, a name then [ARGS], is not read: it stays content
        ('[TOOL_CALLS]f[ARGS]{"x": 1}', '[TOOL_CALLS]f[ARGS]{"x": 1}', []),
        (MISTRAL_CALLS[:68], None, [WEATHER]),  # cut after a call
        (MISTRAL_CALLS[:76], ', {"name', [WEATHER]),  # cut before the next call's name
    ],
)
def test_mistral_whole_texts(text, content, calls):
    assert whole(text, MISTRAL) == (content, calls)


# ---------------------------------------------------------------------- any split

TEXTS = {
    HERMES: [
        "plain words <tool_ and more  ",
        f"Sure thing.  \n{CALL}\n{OTHER}",
        f"{CALL}\n<tool_call>\n{{broken\n</tool_call>\n{OTHER}",
        "<tool_call>\n{broken",
        CALL[:-3],
        CALL[:63],
        '<tool_call>{"arguments": "{\\"x\\": \\"\\ud83d\\ude00\\"}", "name": "f"}</tool_call>\nok',
        '<tool_call>{"name": "f", "arguments": {"a": 12 3}}</tool_call><tool_call>{"name": "g"}',
    ],
    LLAMA3_JSON: [
        f"{LLAMA}; {LLAMA_ADD}",
        f"Well. <|python_tag|>{LLAMA};  {LLAMA_ADD[:30]}",
        '{"a": [1, {"b": 2}]} <|python_ta',
        f" {LLAMA};; x",
    ],
    MISTRAL: [
        f"Ok [TOOL_CALLS] [{MISTRAL_CALLS[13:]} then",
        MISTRAL_CALLS[:-1] + ", 5]",
        '[TOOL_[TOOL_CALLS][[TOOL_CALLS][{"name": "x"',
    ],
}
CASES = [(f, text) for f, texts in TEXTS.items() for text in texts]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_deltas_add_up_to_the_whole_answer_however_the_text_is_cut(case, cuts):
    form, text = case
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    content, calls, _ = streamed(pieces, form)
    assert (content, calls) == whole(text, form)


def test_every_character_read_alone_adds_up_too():
    for form, text in CASES:
        content, calls, _ = streamed([*text, ""], form)
        assert (content, calls) == whole(text, form)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
NAMES = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
STYLES = st.sampled_from(
    [
        {},
        {"separators": (",", ":")},
        {"indent": 1},
        {"ensure_ascii": False},
    ]
)
FORMATS = {
    HERMES: lambda calls: "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls),
    LLAMA3_JSON: lambda calls: "<|python_tag|>" + "; ".join(calls),
    MISTRAL: lambda calls: "[TOOL_CALLS][" + ", ".join(calls) + "]",
}


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(list(FORMATS)),
    st.text(alphabet="ab <>[]{};\n", max_size=12),
    st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    STYLES,
    st.lists(st.integers(0, 400), max_size=8),
)
def test_written_calls_come_back_as_written(form, before, written, style, cuts):
    """Calls of any arguments, in any JSON style, after any text (of characters that cannot
    make a marker): the text is the content, the arguments come back as written."""
    key = "parameters" if form is LLAMA3_JSON else "arguments"
    texts = [json.dumps({"name": name, key: arguments}, **style) for name, arguments in written]
    before = before.strip()
    text = (f"{before} " if before else "") + FORMATS[form](texts)
    content, calls = whole(text, form)
    assert content == (before or None)
    assert [name for name, _ in calls] == [name for name, _ in written]
    for (_, arguments), (_, value), call_text in zip(calls, written, texts):
        assert json.loads(arguments) == value and arguments in call_text
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert streamed(pieces, form)[:2] == whole(text, form)


# ---------------------------------------------------------------------- JSON scanner


def scan(text: str) -> tuple[str, int]:
    """``("end", k)``: text[:k] is a complete value; ``("bad", k)``: text[k] cannot follow;
    ``("open", len)``: a value not complete yet."""
    scanner = JsonValueScanner()
    for k, ch in enumerate(text):
        step = scanner.feed(ch)
        if step is Step.BAD:
            return "bad", k
        if step is not Step.MORE:
            return "end", k + (step is Step.END)
    return ("end" if scanner.complete_at_end() else "open"), len(text)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, STYLES, st.integers(0, 10_000))
def test_the_scanner_accepts_every_json_value_and_its_every_prefix(value, style, cut):
    text = json.dumps(value, **style)
    verdict, end = scan(text + " ")
    assert (verdict, end) == ("end", len(text))
    prefix = text[: cut % (len(text) + 1)]
    assert scan(prefix)[0] != "bad"


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-tfrulnsa\\ \n', max_size=14))
def test_where_the_scanner_ends_a_value_json_agrees(text):
    verdict, end = scan(text)
    if verdict == "end":
        json.loads(text[:end])
    elif verdict == "bad":  # no value begins with the text up to and with that character
        with pytest.raises(ValueError):
            json.loads(text[: end + 1])


@given(st.text())
def test_a_string_decodes_as_json_does(value):
    for ensure_ascii in (True, False):
        scanner = JsonValueScanner()
        for ch in json.dumps(value, ensure_ascii=ensure_ascii):
            scanner.feed(ch)
        decoded = scanner.take_decoded()
        # lone surrogates have no UTF-8: they come back as U+FFFD
        assert decoded == "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in value)


# ---------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "template, name",
    [
        (None, "hermes"),
        ("{{ messages }}", "hermes"),
        ("{% if tools %}<tool_call>{% endif %}", "hermes"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{{ '[TOOL_CALLS]' }}{{ '<tool_call>' }}", "mistral"),
        ({"default": "x", "tool_use": "<|python_tag|>"}, "llama3_json"),
    ],
)
def test_auto_picks_the_chat_template_s_format(template, name):
    assert call_format("auto", template).name == name


def test_each_parser_name_gives_its_format_and_others_are_refused():
    assert [call_format(name).name for name in PARSER_NAMES if name != "auto"] == [
        "hermes",
        "llama3_json",
        "mistral",
    ]
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, .*'qwen'"):
        call_format("qwen")


def test_the_command_line_offers_the_registry_s_names():
    from paged_attention.cli.serve import TOOL_CALL_PARSERS

    assert TOOL_CALL_PARSERS == PARSER_NAMES


# ---------------------------------------------------------------------- grammar


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": DIGIT, "b": DIGIT},
    "required": ["a", "b"],
    "additionalProperties": False,
}
FUNCTIONS = [("add", ADD_PARAMETERS), ("now", None)]


def forced_text(form, calls: list[tuple[str, str]]) -> str:
    """``calls`` (name, arguments JSON) written as the grammar of ``form`` writes them."""
    if form is HERMES:
        tags = [f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls]
        return "\n".join(tags)
    if form is LLAMA3_JSON:
        return "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
    return (
        "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"
    )


def accepts(form, parallel: bool, text: str, functions=FUNCTIONS) -> bool:
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    tag = json.dumps(tool_call_grammar(functions, parallel, form))
    return _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag), text)


FORMS = pytest.mark.parametrize("form", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
ADD_CALL, NOW_CALL = ("add", '{"a": 1, "b": 2}'), ("now", "{}")


@FORMS
def test_the_grammar_writes_calls_that_the_format_s_reader_reads_back(form):
    for parallel, calls in [(True, [ADD_CALL]), (True, [ADD_CALL, NOW_CALL, ADD_CALL])]:
        text = forced_text(form, calls)
        assert accepts(form, parallel, text), text
        assert whole(text, form) == (None, calls)
    assert accepts(form, False, forced_text(form, [NOW_CALL]))


@FORMS
def test_the_grammar_refuses_what_the_tools_do_not_allow(form):
    refused = [
        [],  # no call
        [("add", '{"a": 1}')],  # a required argument missing
        [("add", '{"a": 1, "b": 10}')],  # out of the schema's range
        [("add", '{"a": 1, "b": 2, "c": 3}')],  # an argument the schema does not have
        [("sub", "{}")],  # not a tool
        [("now", "[]")],  # arguments that are not an object
    ]
    for calls in refused:
        assert not accepts(form, True, forced_text(form, calls)), calls
    two = forced_text(form, [ADD_CALL, NOW_CALL])
    assert not accepts(form, False, two)  # one call only without parallel calls
    assert not accepts(form, True, two + " trailing words")
    assert not accepts(form, True, forced_text(form, [ADD_CALL]), [("now", None)])


@pytest.mark.parametrize(
    "form, other", [(HERMES, LLAMA3_JSON), (LLAMA3_JSON, MISTRAL), (MISTRAL, HERMES)]
)
def test_each_format_s_grammar_refuses_the_others_calls(form, other):
    assert not accepts(form, True, forced_text(other, [ADD_CALL]))


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


def test_llama3_calls_carry_parameters_and_mistral_s_open_with_the_marker():
    parameters = {"type": "object"}
    llama = tool_call_grammar([("f", parameters)], False, LLAMA3_JSON)["format"]
    assert llama["type"] == "json_schema"
    assert set(llama["json_schema"]["properties"]) == {"name", "parameters"}
    mistral = tool_call_grammar([("f", parameters)], True, MISTRAL)["format"]
    first, calls, last = mistral["elements"]
    assert (first["value"], last["value"]) == ("[TOOL_CALLS][", "]")
    assert calls["elements"][1]["content"]["elements"][0]["value"] == ", "


def test_the_grammar_needs_a_function_and_a_known_format():
    with pytest.raises(ValueError, match="functions"):
        tool_call_grammar([], True)
    with pytest.raises(ValueError, match="call_format must be one of"):
        tool_call_grammar([("f", None)], True, CallFormat("qwen", markers=("<q>",)))
