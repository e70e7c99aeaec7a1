"""The one boundary between the scheduler (which decides) and the model runner (which executes):
SchedulerOutput holds each scheduled sequence's slice of the step and the page moves to apply before
computing it; StepResult carries the sampled tokens and the page payloads read back. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.request import PromptLogprob, TokenConstraint

from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftSeq:
    """The draft model's share of one sequence's step (speculative method draft_model): compute
    `token_ids`, the known tokens it has not computed yet, at positions start_pos.. in its own pages
    (`block_table`, of the draft's pool), then propose `num_drafts` tokens greedily, one row each."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_drafts: int  # 0: catching up only (the target verifies no draft this step)


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: compute `token_ids` at positions start_pos.. using the pages
    of `block_table` (which covers at least start_pos + len(token_ids) positions)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_sample: bool  # the chunk ends at the last known token: sample the next one
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    num_output_tokens: int = 0  # tokens generated so far; with a seed, makes sampling reproducible
    window_block_table: list[int] | None = None  # pages of the sliding-window layers (hybrid pool)
    # speculative decoding: the last len(draft_token_ids) of token_ids are proposed, not known; the
    # runner verifies them against its own predictions (StepResult.accepted)
    draft_token_ids: list[int] = field(default_factory=list)
    grammar: TokenConstraint | None = None  # structured outputs: the sampler masks this row by it
    output_token_ids: list[int] | None = None  # penalties: the tokens generated so far (else None)
    repetition_token_ids: list[int] | None = None  # the repetition penalty's tokens (SamplingParams.repetition_tokens)
    masked_token_ids: list[int] | None = None  # ids it may not take next: min_tokens, bad_words (Request)
    # a draft model's work: its drafts are not in token_ids yet; the runner proposes them before the
    # target computes the step, and appends them as the last draft.num_drafts rows
    draft: DraftSeq | None = None
    # prompt_logprobs: the prompt token after each of the first len(prompt_targets) rows, whose logprob the
    # runner reads there (none: not asked, or no row of this chunk is followed by a prompt token)
    prompt_targets: list[int] | None = None

    @property
    def num_drafts(self) -> int:
        """Draft tokens the target verifies in this sequence's step."""
        return len(self.draft_token_ids) or (self.draft.num_drafts if self.draft is not None else 0)


@dataclass(slots=True)
class PageOps:
    """Page moves of one step, applied by the runner in this order before it computes:

    1. saves:  read these pages' K/V (pages freed or evicted this step, and committed pages a tier
               wants); nothing below has written them yet. Payloads come back in StepResult.saved;
               each save's second item says where the cache layer sends it (opaque here).
    2. loads:  write (page_id, payload) into pages (swap-in, load-back from a tier).
    3. copies: copy page src -> dst (copy-on-write, partial prefix hits); window_copies: the same in
               the sliding-window layers' pool (hybrid allocator).
    """

    saves: list[tuple[int, Any]] = field(default_factory=list)
    loads: list[tuple[int, Any]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.copies or self.window_copies)


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    page_ops: PageOps = field(default_factory=PageOps)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # log-softmax of the raw logits at the chosen token
    top_logprobs: dict[int, float] | None = None  # the `logprobs` most likely alternatives


@dataclass(slots=True)
class StepResult:
    sampled: list[SampledToken | None] = field(default_factory=list)  # aligned with seqs
    saved: list[Any] = field(default_factory=list)  # payloads of page_ops.saves, in order
    # aligned with seqs where any seq carried drafts: the draft tokens verification accepted, in order
    # (sampled[i] is then the token after them: the correction or the bonus token)
    accepted: list[list[SampledToken]] = field(default_factory=list)
    # aligned with seqs where any seq had prompt_targets: each target's PromptLogprob, in order
    prompt_logprobs: list[list[PromptLogprob] | None] = field(default_factory=list)
