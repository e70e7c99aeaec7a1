"""The request fields that constrain the output, read into one StructuredOutputsParams: on
/v1/chat/completions and /v1/completions OpenAI's `response_format` (`text`, `json_object`, `json_schema`
with `strict`), vLLM's `structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`; on /v1/messages Anthropic's `output_config.format` (`{"type":
"json_schema", "schema": ...}`) and its beta spelling, top-level `output_format`. At most one of them
may constrain a request (`one_constraint`, for both APIs); a constraint that cannot compile is a 400
whose `param` names the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from kvserve.structured import GrammarError, StructuredOutputsParams


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Annotated[StrictStr, Field(max_length=64)] | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object (its whitespace and backend options are ignored: kvserve has
    one engine and fixed separators)."""

    model_config = ConfigDict(extra="ignore")
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class StructuredFields(BaseModel):
    """Mixed into both endpoints' request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint (compiled later, off the event loop); GrammarError naming the field."""
        return one_constraint(self._constraints())

    def _constraints(self) -> list[StructuredOutputsParams | None]:
        out = [self._response_format()]
        so = self.structured_outputs
        if so is not None:
            kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                     "json_object": so.json_object or None}
            given = {k: v for k, v in kinds.items() if v is not None}
            if len(given) != 1:
                raise GrammarError("give exactly one of json, regex, choice, grammar, json_object",
                                   "structured_outputs")
            (kind, value), = given.items()
            out.append(StructuredOutputsParams(**{kind: value}, field=f"structured_outputs.{kind}"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                out.append(StructuredOutputsParams(**{kind: value}, field=name))
        return out

    def _response_format(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True, field="response_format")
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise GrammarError("a response_format of type json_schema needs json_schema.schema",
                               "response_format.json_schema")
        return StructuredOutputsParams(json=rf.json_schema.json_schema, strict=rf.json_schema.strict,
                                       field="response_format.json_schema.schema")


def one_constraint(constraints: list[StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    """The one constraint a request gives (None: none); GrammarError naming the field when two fields
    constrain the output. (Whether it compiles is found off the event loop, by the engine's grammar
    workers: a check here would hold every tenant's requests while a huge schema is read.)"""
    found = [c for c in constraints if c is not None]
    if len(found) > 1:
        raise GrammarError(f"{found[1].field} and {found[0].field} both constrain the output; "
                           "send one", found[1].field)
    if not found:
        return None
    return found[0]


class AnthropicJSONFormat(BaseModel):
    """Anthropic's JSON output format: `{"type": "json_schema", "schema": {...}}`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")


class AnthropicOutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: AnthropicJSONFormat | None = None


class AnthropicStructuredFields(BaseModel):
    """Mixed into /v1/messages' request model. The output follows the schema as Anthropic's
    structured outputs guarantee it (strict: a keyword the grammar cannot enforce is a 400)."""

    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicJSONFormat | None = None  # the beta's spelling, still accepted there

    def output_constraint(self) -> StructuredOutputsParams | None:
        config = self.output_config.format if self.output_config is not None else None
        return one_constraint([_anthropic_format(config, "output_config.format"),
                               _anthropic_format(self.output_format, "output_format")])


def _anthropic_format(fmt: AnthropicJSONFormat | None, field: str) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    if fmt.json_schema is None:
        raise GrammarError("a format of type json_schema needs its schema", f"{field}.schema")
    return StructuredOutputsParams(json=fmt.json_schema, strict=True, field=f"{field}.schema")
