"""GrammarCompiler: StructuredOutputsParams -> a validated llguidance grammar for one model's tokenizer,
and fresh per-sequence GrammarStates from it. The tokenizer's preprocessing (~0.5 s for SmolLM2's
49k tokens) happens once per tokenizer in a process. A grammar is compiled once per tenant: the
outcome (the grammar, or the GrammarError it raised) is kept by (tenant namespace, grammar text), so
a retry of a failed grammar costs no second compile and one tenant's cache tells another nothing
(a hit would be a timing oracle). Each sequence's state is a copy of the compiled matcher (cheap),
not a new compile (seconds for a 10,000-property schema)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance

from kvserve.structured.params import GrammarError, StructuredOutputsParams
from kvserve.structured.state import GrammarState

log = logging.getLogger("kvserve.structured")

MAX_CACHED_GRAMMARS = 256
# Fixed separators (", " and ": "): flexible whitespace lets a sampled model pad forever.
JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_GRAMMAR_BYTES = 1 << 20


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (not yet checked against a tokenizer). Raises
    GrammarError for a constraint that is not even well-formed."""
    field = params.field
    kind = params.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise GrammarError(f"the JSON schema is not valid JSON ({err})", field) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object", field)
        schema = closed_objects(schema)
        overrides = None if params.strict else {"lenient": True}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS,
                                                                 overrides=overrides)
        except (ValueError, TypeError) as err:
            raise GrammarError(f"the JSON schema cannot be read: {err}", field) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:  # a Lark grammar, or GBNF (llama.cpp's `root ::= ...`) translated to Lark
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as err:
        raise GrammarError(str(err), field) from None


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def lark_json(schema: dict[str, Any]) -> str:
    """`%json{...}`: a JSON schema to embed in a Lark grammar, with the same whitespace rule and closed
    objects as a top-level `json` constraint (a bare %json would allow free whitespace)."""
    schema = closed_objects(schema)
    schema["x-guidance"] = {**JSON_DEFAULTS, **schema.get("x-guidance", {})}
    return "%json" + json.dumps(schema)


def closed_objects(schema: Any) -> Any:
    """A copy where an object schema that lists `properties` and says nothing of others gets
    `additionalProperties: false` (as xgrammar's strict mode and OpenAI's strict schemas do): extra
    keys are valid JSON Schema, but a sampled model would invent them without end."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if "properties" in out and not {"additionalProperties", "patternProperties",
                                    "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar checked against the tokenizer; new_state() gives each sequence its own matcher, a
    copy of the compiled one at its start."""

    grammar: str
    prototype: Any  # llguidance.LLMatcher, never advanced
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def new_state(self) -> GrammarState:
        return GrammarState(self.prototype.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarCompiler:
    """One per (tokenizer, vocabulary size, EOS ids). `compile` raises GrammarError (a ValueError)
    naming the request field for a grammar that does not compile or can match nothing."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self.startup_s = time.perf_counter() - start
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        log.info("structured outputs: llguidance %s preprocessed the %d-token vocabulary in %.0f ms",
                 llguidance_version(), vocab_size, self.startup_s * 1e3)

    def compile(self, params: StructuredOutputsParams, namespace: str = "") -> CompiledGrammar:
        """The compiled grammar of `params` for tenant `namespace`, or its GrammarError, from the
        cache when this tenant compiled it before."""
        grammar = to_grammar(params)
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes", params.field)
        key = (namespace, grammar)
        found = self._cached(key)
        if found is None:
            try:
                found = self._compile(grammar, params.field)
            except GrammarError as err:
                found = err
            self.remember(key, found)
        if isinstance(found, GrammarError):
            raise GrammarError(found.reason, params.field)
        return found

    def key_of(self, params: StructuredOutputsParams, namespace: str = "") -> tuple[str, str]:
        return namespace, to_grammar(params)

    def remember(self, key: tuple[str, str], outcome: CompiledGrammar | GrammarError) -> None:
        """Keep a compile's outcome (a failure too: a budget exceeded, a grammar llguidance refused)."""
        with self._lock:
            self._cache[key] = outcome
            self._cache.move_to_end(key)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)

    def _cached(self, key: tuple[str, str]) -> CompiledGrammar | GrammarError | None:
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            return found

    def _compile(self, grammar: str, field: str | None) -> CompiledGrammar:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(_one_line(error), field)
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        compiled = CompiledGrammar(grammar, prototype, self.vocab_size, self.eos_token_ids)
        probe = compiled.new_state()
        if probe.error:
            raise GrammarError(_one_line(probe.error), field)
        if not probe.can_start():
            raise GrammarError("the grammar cannot match any text", field)
        return compiled


def llguidance_version() -> str:
    version = llguidance.get_version() if hasattr(llguidance, "get_version") else ""
    return version.split()[0].removeprefix("llguidance@") if version else "?"


def _one_line(message: str, limit: int = 400) -> str:
    """llguidance's errors span lines (a source excerpt with a caret): one line for a JSON body."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip() not in ("", "^"))
    return text if len(text) <= limit else text[:limit - 3] + "..."
