"""Structured output: a request's tokens constrained by a grammar (a JSON schema, any JSON
object, an EBNF grammar, a regular expression or an xgrammar structural tag), with xgrammar.

Three parts:

* :class:`StructuredOutputParams` — what a request asks for, checked when it is built and plain
  data (picklable: the engine may run in another process; nothing is compiled here);
* :class:`GrammarCompiler` — one per engine: the tokenizer's vocabulary as xgrammar reads it,
  built once, and xgrammar's compiler, whose cache keeps every grammar compiled so far; a
  grammar that does not compile is refused when the request is added;
* :class:`RequestGrammar` — a request's compiled grammar and one matcher per sequence (the
  samples of ``n > 1`` each have their own), advanced lazily: before each step a matcher
  consumes the tokens its sequence accepted since the last one, so that neither the scheduler
  nor a rolled-back step has to tell it anything. :func:`apply_grammars` masks the rows of a
  step's logits that a grammar constrains with one bitmask tensor (xgrammar's kernel).

A matcher that reached the end of its grammar allows only the engine's end-of-sequence tokens,
so a constrained sequence ends as ``"eos"`` once its output is complete.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from paged_attention.engine.request import RequestError

ARGUMENT = "structured_output"

KINDS = ("json", "json_object", "grammar", "regex", "choice", "structural_tag")


def _json_text(name: str, value, kinds: tuple[type, ...]) -> str:
    """``value`` (a JSON document as text, or as Python data of ``kinds``) as compact JSON
    text; a RequestError naming ``structured_output.<name>`` if it is not JSON."""
    where = f"{ARGUMENT}.{name}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise RequestError(f"{where} is not valid JSON: {error}", ARGUMENT) from None
    if not isinstance(value, kinds):
        shown = " or ".join(k.__name__ for k in kinds)
        raise RequestError(
            f"{where} must be a {shown} (or its JSON text), got {type(value).__name__}", ARGUMENT
        )
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise RequestError(f"{where} is not JSON data: {error}", ARGUMENT) from None


@dataclass(frozen=True)
class StructuredOutputParams:
    """The grammar a request's output must follow: exactly one of ``json`` (a JSON schema, as
    a dict, a bool or JSON text), ``json_object=True`` (any JSON object), ``grammar`` (EBNF
    text, xgrammar's dialect, root rule ``root``), ``regex``, ``choice`` (a list of strings:
    the output is exactly one of them) or ``structural_tag`` (xgrammar's structural tag, as a
    dict or JSON text). JSON is generated without free whitespace unless
    ``any_whitespace`` (a model may otherwise fill its budget with blanks): schemas get
    ``", "`` and ``": "`` separators. Schemas are strict: no property or item the schema does
    not name. ``json`` and ``structural_tag`` are kept as JSON text (the object stays hashable
    and picklable)."""

    json: str | dict | bool | None = None
    json_object: bool = False
    grammar: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    structural_tag: str | dict | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("json_object", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(
                    f"{ARGUMENT}.{name} must be True or False, got {getattr(self, name)!r}",
                    ARGUMENT,
                )
        for name in ("grammar", "regex"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise RequestError(
                    f"{ARGUMENT}.{name} must be a non-empty string, got {value!r}", ARGUMENT
                )
        if self.choice is not None:
            choices = self.choice
            if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
                raise RequestError(
                    f"{ARGUMENT}.choice must be a non-empty list of strings, got {choices!r}",
                    ARGUMENT,
                )
            if not all(isinstance(c, str) and c for c in choices):
                raise RequestError(
                    f"{ARGUMENT}.choice entries must be non-empty strings, got {choices!r}",
                    ARGUMENT,
                )
            object.__setattr__(self, "choice", tuple(choices))
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            shown = ", ".join(given) if given else "none"
            raise RequestError(
                f"{ARGUMENT} needs exactly one of {', '.join(KINDS)}; got {shown}", ARGUMENT
            )
        if self.json is not None:
            object.__setattr__(self, "json", _json_text("json", self.json, (dict, bool)))
        if self.structural_tag is not None:
            tag = _json_text("structural_tag", self.structural_tag, (dict,))
            object.__setattr__(self, "structural_tag", tag)

    @property
    def kind(self) -> str:
        """Which of :data:`KINDS` it is."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))


# One vocabulary description per tokenizer object (building it walks the whole vocabulary).
_TOKENIZER_INFOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's description of ``tokenizer``'s vocabulary, padded to the model's
    ``vocab_size`` (its logits' width), built once per tokenizer and size."""
    import xgrammar

    try:
        per_size = _TOKENIZER_INFOS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable: built for each compiler
        per_size = {}
    if vocab_size not in per_size:
        per_size[vocab_size] = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size
        )
    return per_size[vocab_size]


# xgrammar's messages start with a time and its source location, which tell a client nothing.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarCompiler:
    """Compiles requests' grammars for one engine's ``tokenizer`` and ``vocab_size`` (the
    model's logits' width); xgrammar's cache keeps each compiled grammar, so a schema many
    requests share is compiled once. Built at the first structured request."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size), max_threads=1
        )

    def compile(self, params: StructuredOutputParams):
        """``params``' grammar compiled; a RequestError naming ``structured_output`` (with
        xgrammar's reason) if it is not a grammar xgrammar can compile."""
        kind = params.kind
        compiler = self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    params.json, any_whitespace=params.any_whitespace, strict_mode=True
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=params.any_whitespace, strict_mode=False
                )
            if kind == "grammar":
                return compiler.compile_grammar(params.grammar)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":  # EBNF string literals take JSON's escapes
                alternatives = (json.dumps(c, ensure_ascii=False) for c in params.choice)
                return compiler.compile_grammar("root ::= " + " | ".join(alternatives))
            return compiler.compile_structural_tag(params.structural_tag)
        except (RuntimeError, ValueError, TypeError) as error:
            reason = _XGRAMMAR_PREFIX.sub("", str(error).strip().split("\n")[0])
            raise RequestError(
                f"{ARGUMENT}.{kind} could not be compiled into a grammar: "
                f"{reason or type(error).__name__}",
                ARGUMENT,
            ) from None


class RequestGrammar:
    """A request's compiled grammar and the matcher of each of its sequences (by
    ``seq_id``), each with how many of its sequence's tokens it consumed."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self._matchers: dict[int, tuple[object, int]] = {}

    def matcher(self, seq_id: int, tokens: Sequence[int], end_tokens: Collection[int]):
        """The matcher of sequence ``seq_id`` after ``tokens`` (all it generated so far): a new
        one for a new sequence (a sample forked from the prompt starts where the grammar
        starts), advanced by the tokens it has not consumed yet. ``end_tokens``: the
        engine's end-of-sequence ids, which the grammar's end allows."""
        import xgrammar

        matcher, consumed = self._matchers.get(seq_id, (None, 0))
        if matcher is None:
            stops = sorted(end_tokens) or None
            matcher = xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=stops)
        for token in tokens[consumed:]:
            if not matcher.accept_token(token):
                # cannot happen: every token drawn was allowed by this matcher's mask
                raise RuntimeError(f"sequence {seq_id}: the grammar refused its token {token}")
        self._matchers[seq_id] = (matcher, len(tokens))
        return matcher


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, object]]) -> None:
    """Masks (in place) every token of ``logits`` that the grammar of each ``(row,
    matcher)`` forbids next: one bitmask for the step, filled by each matcher, applied to those
    rows at once on the logits' device."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(logits), logits.shape[-1])
    for row, matcher in rows:
        matcher.fill_next_token_bitmask(bitmask, row)
    indices = [row for row, _ in rows]
    xgrammar.apply_token_bitmask_inplace(
        logits,
        bitmask.to(logits.device, non_blocking=True),
        indices=indices,
        backend=mask_backend(logits.device),
    )


def mask_backend(device: torch.device) -> str:
    """xgrammar's kernel for logits on ``device``: its C++ one on a CPU, its Triton one on a
    CUDA device where Triton is installed, else its plain PyTorch one (xgrammar's own choice,
    Triton, would fail to import without it)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch_native"
        return "triton"
    return "torch_native"
