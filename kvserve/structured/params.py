"""StructuredOutputsParams: what a request constrains its output to (vLLM's shape), a plain value that
travels in SamplingParams; nothing here compiles or imports the grammar engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A constraint that cannot be compiled or can never match. `field` names the request field it
    came from (e.g. "response_format.json_schema.schema"), so the server's 400 points at it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of:

    json         a JSON schema (dict, or its JSON text): the output is one JSON value that validates
    json_object  True: the output is one JSON object (OpenAI's `response_format: json_object`)
    regex        the whole output matches this regular expression
    choice       the output is exactly one of these strings
    grammar      a Lark grammar (llguidance's dialect: `start:` rule, regex terminals, `%json{...}`
                 to embed a JSON schema) or a GBNF/EBNF grammar (rules `root ::= ...`)

    strict: for `json`, True refuses a schema keyword the engine cannot enforce (400); False or None
    ignores such keywords (the output still follows the rest of the schema). `field` is where the
    constraint came from in the request, for error messages.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool | None = None
    field: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            raise GrammarError("give exactly one of json, json_object, regex, choice, grammar"
                               + (f" (got {', '.join(set_)})" if set_ else ""), self.field)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise GrammarError("choice must be a non-empty list of strings", self.field)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise GrammarError(f"{name} must be a non-empty string", self.field)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise GrammarError("a JSON schema must be an object", self.field)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))
