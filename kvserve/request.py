"""A request in the engine and what it gives back: the Request state, its stop rules, RequestOutput
(what it asks the sampler for: sampling_params.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.cache.explain import CacheExplanation
from kvserve.cache.hashing import namespace as cache_namespace
from kvserve.cache.leases import Breakpoint, LeaseUsage, Retention
from kvserve.sampling_params import SamplingParams
from kvserve.token_bans import BadWordTokens, completed_by, masked_ids


class TokenConstraint(Protocol):
    """One sequence's grammar state (kvserve.structured.state.GrammarState), as the sampler and the
    scheduler see it: the sampler reads the allowed next tokens, the scheduler advances it."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None: ...  # int32 words [rows, ceil(vocab / 32)]

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_finished(self) -> bool: ...

    @property
    def violation(self) -> str: ...  # why output ending here is outside the grammar ("" if inside)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the output cannot meet its constraint (Request.error says why): never "stop"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


CacheLease = Breakpoint  # the name the server and the Python API pass breakpoints by


@dataclass(frozen=True, slots=True)
class ToolCallKV:
    """A chat request with tools: `hold` keeps its conversation's KV leased when it finishes (the
    server releases the lease unless the answer was a tool call); `answers` are the holds of the
    earlier answers whose tool results it brings (released once it is admitted)."""

    hold: bool = False
    answers: tuple[str, ...] = ()
    hold_s: float | None = None  # the hold's TTL in seconds, lease_ttl_scale applied (None: --tool-call-kv-ttl)


@dataclass(slots=True)
class LeaseInfo:
    lease_id: str
    num_tokens: int
    expires_at: float  # unix time


@dataclass(slots=True)
class CacheOutcome:
    """What a request got from the cache, as one value: cached prompt tokens by source (first
    admission), what its breakpoints' leases did, and why it hit or missed (kv_explain)."""

    num_cached_tokens: int = 0
    cached_by_source: dict[str, int] = field(default_factory=dict)
    lease_usage: LeaseUsage | None = None
    explanation: CacheExplanation | None = None
    held_lease_id: str | None = None  # the tool-call hold granted when it finished
    hold_refused: str | None = None  # why none was (a LeaseRefusal)


@dataclass(slots=True)
class SpecDecodeCounts:
    """A request's speculative decoding, counted as vLLM's spec_decode_* metrics count it globally."""

    num_drafts: int = 0  # steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class Request:
    """One sequence in the engine. `token_ids` = prompt + generated; the model has computed KV for
    the first `num_computed_tokens` of them, held in pages the cache manager tracks by request id."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (eos, end of turn, eom)
    tenant: str = ""  # whose cache: an API key's namespace, "" for none
    cache_salt: str | None = None  # the request's own salt: only requests with the same one share pages
    bad_words_token_ids: BadWordTokens = ()  # SamplingParams.bad_words as tokens (token_bans.py)
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled_time: float | None = None  # the start of the first step that computed it (queue time's end)
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # prompt_logprobs asked: entry i for prompt token i, None for the first (and until its row is computed)
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    # n > 1: the other samples wait here until this request has computed all but its last prompt
    # token, then fork its pages (shared by ref count, copied on first write)
    fork_children: list[Request] = field(default_factory=list)
    retention: Retention | None = None  # breakpoints the cache leases once the prompt is committed
    kv_explain: bool = False  # explain the prefix-cache outcome at first admission (kv_cache)
    tool_call: ToolCallKV | None = None
    hold_ttl_s: float = 0.0  # tool_call.hold: the TTL of the hold (--tool-call-kv-ttl)
    cache: CacheOutcome = field(default_factory=lambda: CacheOutcome())
    spec_decode: SpecDecodeCounts = field(default_factory=lambda: SpecDecodeCounts())
    namespace: str = field(init=False, default="")  # cache.hashing.namespace(tenant, cache_salt)
    grammar: TokenConstraint | None = None  # structured outputs: advanced by each sampled token
    error: str | None = None  # FINISHED_ERROR: why (e.g. the grammar needed a token that ends the output)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS and the rest)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        salt = self.cache_salt
        if self.sampling_params.prompt_logprobs is not None:  # every prompt row computed: a namespace of its own
            salt = f"{salt or ''}:prompt-logprobs:{self.request_id}"
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.namespace = cache_namespace(self.tenant, salt)

    @property
    def num_cached_tokens(self) -> int:
        return self.cache.num_cached_tokens

    @property
    def lease_usage(self) -> LeaseUsage | None:
        return self.cache.lease_usage

    @property
    def kv_cache(self) -> dict | None:
        return None if self.cache.explanation is None else self.cache.explanation.as_dict()

    def append_output(self, token_id: int) -> None:
        """A sampled token joins the sequence, and its grammar (the one place a grammar advances)."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def stop_status(self) -> RequestStatus:
        """How a sequence that stops here (EOS, a stop token id, its grammar done) ends: "stop", or
        FINISHED_ERROR (with `error`) when its grammar is not satisfied by the output so far, which the
        engine could not enforce (an end-of-sequence token the grammar itself asked for, a matcher
        error): a client must never get output outside its constraint as a normal stop."""
        violation = self.grammar.violation if self.grammar is not None else ""
        if not violation:
            return RequestStatus.FINISHED_STOPPED
        self.error = violation
        return RequestStatus.FINISHED_ERROR

    def stop_after_token(self, max_model_len: int) -> RequestStatus | None:
        """How the sequence ends with the token it just took, if it does: EOS, a stop token id, its grammar
        done, max_tokens or the context's end; none of the first three before min_tokens."""
        params, last = self.sampling_params, self.token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and self.is_eos(last):
                return self.stop_status()  # (FINISHED_ERROR if a grammar is left unsatisfied)
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                return self.stop_status()
            if self.is_grammar_complete:
                return self.stop_status()
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def is_eos(self, token_id: int) -> bool:
        return token_id == self.eos_token_id or token_id in self.eos_token_ids

    @property
    def ended_by_eos(self) -> bool:
        return (self.status is RequestStatus.FINISHED_STOPPED and not self.sampling_params.ignore_eos
                and self.stop_reason is None and self.is_eos(self.token_ids[-1]))

    def masked_token_ids(self) -> list[int] | None:
        """The ids the sampler masks for its next token (token_bans.py): under min_tokens those that would end
        the output (EOS unless ignored, stop_token_ids), and those that would complete a bad word."""
        params = self.sampling_params
        holds_endings = self.num_output_tokens < params.min_tokens
        if not holds_endings and not self.bad_words_token_ids:
            return None
        endings: set[int] = set()
        if holds_endings:
            eos = [] if params.ignore_eos else [t for t in (self.eos_token_id, *self.eos_token_ids) if t is not None]
            endings = {*eos, *(params.stop_token_ids or [])}
        word_bans = completed_by(self.output_token_ids, self.bad_words_token_ids)
        return masked_ids(endings, word_bans, params.allowed_token_ids)

    @property
    def is_grammar_complete(self) -> bool:
        """Structured outputs: the grammar is complete and nothing may follow (the sequence stops)."""
        return self.grammar is not None and self.grammar.is_finished

    def prompt_targets(self, start: int, num_new: int) -> list[int] | None:
        """prompt_logprobs: the prompt tokens after rows start..start + num_new (each row's logits give the
        next token's logprob); None where none is asked or no row is followed by a prompt token."""
        if self.sampling_params.prompt_logprobs is None:
            return None
        return self.prompt_token_ids[start + 1:min(start + num_new, self.num_prompt_tokens - 1) + 1] or None

    def record_prompt_logprobs(self, start: int, entries: list[PromptLogprob]) -> None:
        """Those of the prompt tokens after rows start.. (a recompute after preemption writes the same again)."""
        self.prompt_logprobs[start + 1:start + 1 + len(entries)] = entries

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class PromptLogprob:
    """One prompt token's logprob given the tokens before it, its rank in the vocabulary (1: the most
    likely), and the `prompt_logprobs` most likely tokens there."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # finish_reason "error": why
    stop_reason: str | int | None = None  # finish_reason "stop" by a stop string or stop token id (vLLM's field)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    first_scheduled_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    lease_usage: LeaseUsage | None = None
    kv_cache: dict | None = None  # why the prompt hit or missed the prefix cache (kv_explain)
    spec_decode: SpecDecodeCounts | None = None  # with speculative decoding on: drafts and accepted tokens
    held_lease_id: str | None = None  # a tool-call hold on the conversation's pages (finished only)
    prompt_logprobs: list[PromptLogprob | None] | None = None  # asked by prompt_logprobs: one per prompt token
    hold_refused: str | None = None
