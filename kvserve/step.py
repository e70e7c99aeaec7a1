"""One engine step over an executor, torch-free: the same function runs the model (LLMEngine, with the
ModelRunner) and the simulator (`kvserve simulate`, with a virtual-clock executor that "computes" tokens
without a model), so leases, tiers and explanations are simulated because they are not reimplemented.

    manager.expire_leases()           leases whose TTL ran out give their pages back
    out = scheduler.schedule()        which tokens of which requests, and the page moves (batch.PageOps)
    result = executor.execute(out)    page moves, then the tokens computed and sampled
    manager.tiers.complete(...)       the pages read for the tiers go to them (swap, offload)
    scheduler.update(out, sampled)    tokens appended, pages committed (breakpoints leased), stop rules
    page moves committed this step    pages a shared tier (Redis, disk) wants, read now while they hold
                                      this step's K/V, through the executor's page-ops call
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.batch import PageOps, SchedulerOutput, StepResult
from kvserve.request import Request
from kvserve.scheduler import Scheduler


class Executor(Protocol):
    """What computes a step: model/runner.ModelRunner, or the simulator's virtual clock."""

    def execute(self, out: SchedulerOutput) -> StepResult: ...

    def apply_page_ops(self, ops: PageOps) -> list[Any]: ...


@dataclass(slots=True)
class StepOutcome:
    out: SchedulerOutput
    changed: list[Request] = field(default_factory=list)  # requests that got a token (finished ones too)


def run_step(scheduler: Scheduler, executor: Executor, clock: Callable[[], float]) -> StepOutcome:
    manager = scheduler.manager
    manager.expire_leases()
    start = clock()
    out = scheduler.schedule()
    for seq in out.seqs:  # a request's queue time ends with the first step that computes it
        request = scheduler.requests[seq.request_id]
        if request.first_scheduled_time is None:
            request.first_scheduled_time = start
    if not out.seqs:
        _apply(scheduler, executor, out.page_ops)  # (what an empty schedule still decided)
        return StepOutcome(out)
    result = executor.execute(out)
    manager.tiers.complete(out.page_ops.saves, result.saved)
    for seq, entries in zip(out.seqs, result.prompt_logprobs):  # (prompt_logprobs asked: before the update)
        if entries and seq.request_id in scheduler.requests:
            scheduler.requests[seq.request_id].record_prompt_logprobs(seq.start_pos, entries)
    changed = scheduler.update(out, result.sampled, clock(), result.accepted)
    _apply(scheduler, executor, PageOps(*manager.tiers.take_page_moves()))
    return StepOutcome(out, changed)


def _apply(scheduler: Scheduler, executor: Executor, ops: PageOps) -> None:
    """Page moves outside a model step: a prefill instance writes the pages Redis wants before it
    replies (its decode instance reads them next)."""
    if ops:
        scheduler.manager.tiers.complete(ops.saves, executor.apply_page_ops(ops))
