"""What an engine process of the bench runs (RunSpec) and how it reports progress (Reporter); shared
by the process launcher and every engine runner."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.tools.bench.workload import Loops

WARMUP_IDS = list(range(1000, 1064))


@dataclass(slots=True)
class RunSpec:
    """What one engine process runs (pickled to a spawned process)."""

    engine: str
    model_path: str
    token_ids: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after t0 at which each request is submitted
    engine_kwargs: dict = field(default_factory=dict)
    threads: int | None = None
    json_schema: dict | None = None  # --vs grammar: every request constrained by this JSON schema
    loops: Loops | None = None  # a closed-loop workload (the agent trace), run by agent_run.py



class Reporter:
    """Progress from an engine process to the parent: a phase name, output tokens done (throttled)."""

    def __init__(self, queue) -> None:
        self.queue, self.last = queue, 0.0

    def phase(self, name: str) -> None:
        self.queue.put(("phase", name))

    def tokens(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last > 0.1:
            self.last = now
            self.queue.put(("tokens", done))

    def warm_up_then_count(self, warm_up: Callable[[], object]) -> Callable[[], None]:
        """Run `warm_up()` as the warm-up phase, enter the running phase, and return a callback a
        one-token-at-a-time peer calls per output token to report its count."""
        self.phase("warm-up")
        warm_up()
        self.phase("running")
        done = 0

        def on_token() -> None:
            nonlocal done
            done += 1
            self.tokens(done)

        return on_token


def wait_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)
