"""SpecPolicy: how many draft tokens each decoding request gets this step, and what verification did.

Drafts are proposed only where they can pay: a request decoding one token at a time (no prompt chunk,
no pending fork, no stop strings, which are cut from text), while at most `disable_by_batch_size`
requests decode, and only into pages that are free without evicting a cached one (so speculation never
changes what the prefix cache holds). Each request's k adapts to its acceptance, since a rejected row
costs nearly a decode row where the matmul is compute-bound (torch's packed int4 kernels): a fully
accepted draft raises k by one, a fully rejected one halves it; at 0 the request's drafts stop for
`cooldown` steps (doubling while nothing is accepted), then it tries one token again.

With a draft model (method draft_model) the policy sizes the drafts the same way, within the draft's
own pages (draft_kv.py: a request whose draft pages cannot be had gets no drafts), and the runner
proposes them in the step; its K/V is rolled back with the target's after verification."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.batch import DraftSeq
from kvserve.request import Request
from kvserve.speculative_config import SpeculativeConfig
from kvserve.speculative.draft_kv import DraftKV
from kvserve.speculative.ngram import propose_ngram

COOLDOWN_STEPS = 8  # decode steps without drafts after k fell to 0 (doubles each time, up to MAX_COOLDOWN)
MAX_COOLDOWN = 256


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec_decode counters, cumulative."""

    num_drafts: int = 0  # verification steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass(slots=True)
class Drafts:
    """What a request's step carries: `num_tokens` draft rows for the target to verify, with their
    tokens where the proposer knows them now (n-gram). A draft model's are proposed by the runner in
    the step (`work`: its catch-up and drafts; num_tokens 0 while it only catches up)."""

    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    work: DraftSeq | None = None


@dataclass(slots=True)
class _Adaptive:
    k: int
    cooldown: int = 0  # steps left without drafts
    next_cooldown: int = COOLDOWN_STEPS


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, page_size: int, num_pages: int = 0,
                 max_catch_up: int = 2048) -> None:
        self.config = config
        self.page_size = page_size
        self.stats = SpecDecodeStats()
        self._state: dict[str, _Adaptive] = {}
        # the draft model's pages: as many as the target pool's (num_pages, the same memory budget)
        self.draft_kv = DraftKV(num_pages, page_size, max_catch_up) if config.method == "draft_model" else None

    def wants_drafts(self, num_decoding: int) -> bool:
        """Whether this step speculates at all: not while the batch is large."""
        return num_decoding <= self.config.disable_by_batch_size

    def drafts(self, request: Request, budget: int, max_model_len: int, spare_pages: int) -> Drafts | None:
        """Drafts for `request`'s next step (after its one decode token), within the step's token
        `budget` and `spare_pages` pages free of cached content; None: no drafts."""
        params = request.sampling_params
        if (request.num_computed_tokens != request.num_tokens - 1 or request.num_output_tokens < 1
                or request.fork_children or params.stop or request.grammar is not None
                or params.adjusts_logits):
            return None  # (drafts would be verified against unmasked, unpenalized predictions)
        state = self._state.setdefault(request.request_id, _Adaptive(self.config.num_speculative_tokens))
        if state.cooldown > 0:
            state.cooldown -= 1
            return None
        limit = min(state.k, budget - 1, params.max_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens - 1)
        if limit < 1:
            return None
        ps, start = self.page_size, request.num_computed_tokens
        while limit > 0 and -(-(start + 1 + limit) // ps) - -(-(start + 1) // ps) > spare_pages:
            limit -= 1  # each page past the decode token's must be free without an eviction
        if self.draft_kv is None:
            cfg = self.config
            tokens = propose_ngram(request.token_ids, limit, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            return Drafts(len(tokens), tokens) if tokens else None
        if not self.draft_kv.caught_up(request):
            return Drafts(0)  # the draft computes the request's tokens first
        while limit > 0 and not self.draft_kv.fits(request, limit):
            limit -= 1
        return Drafts(limit) if limit > 0 else None

    def start(self, request: Request, drafts: Drafts) -> Drafts | None:
        """The target's pages for the drafts are taken: take the draft model's (its work this step)."""
        if self.draft_kv is None:
            return drafts
        drafts.work = self.draft_kv.plan(request, drafts.num_tokens)
        assert drafts.work is not None or drafts.num_tokens == 0, "drafts() checked the draft's pages"
        return drafts if drafts.work is not None else None

    def verified(self, request_id: str, work: DraftSeq, num_accepted: int) -> None:
        """After verification: the draft's K/V of rejected drafts rolled back (draft_kv.py)."""
        if self.draft_kv is not None:
            self.draft_kv.verified(request_id, work, num_accepted)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """What verification kept of the request's draft; adapts its k."""
        self.stats.record(num_drafted, num_accepted)
        counts = request.spec_decode
        counts.num_drafts += 1
        counts.num_draft_tokens += num_drafted
        counts.num_accepted_tokens += num_accepted
        state = self._state.get(request.request_id)
        if state is None:
            return
        if num_accepted > 0:
            state.next_cooldown = COOLDOWN_STEPS
        if num_accepted == num_drafted:
            state.k = min(state.k + 1, self.config.num_speculative_tokens)
        elif num_accepted == 0:
            state.k //= 2
            if state.k == 0:
                state.k, state.cooldown = 1, state.next_cooldown
                state.next_cooldown = min(2 * state.next_cooldown, MAX_COOLDOWN)

    def preempted(self, request_id: str) -> None:
        """Preempted (recompute or swap): the draft's K/V goes; it is recomputed when the request runs."""
        if self.draft_kv is not None:
            self.draft_kv.free(request_id)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        self.preempted(request_id)
