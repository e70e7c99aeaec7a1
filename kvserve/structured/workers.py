"""Grammar compiles for the server, off the event loop and off the engine thread, within a time budget:
a request waits alone for its grammar (the engine's steps and every other tenant go on), identical
requests of one tenant share one compile, and a constraint that does not compile within the budget
is answered with a 400 naming the limit, at once for its retries (no second compile). A compile past
its budget cannot be stopped (llguidance runs it in one call), so it keeps its worker until it ends:
one tenant may hold at most MAX_PER_TENANT workers that way, and its next constraint is refused
until one ends."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from kvserve.structured.params import GrammarError, StructuredOutputsParams

DEFAULT_BUDGET_S = 10.0
MAX_REMEMBERED_TIMEOUTS = 256
NUM_WORKERS = 4  # concurrent compiles
MAX_PER_TENANT = 2  # compiles one tenant may have running (past their budget too): the others keep workers
# A compile runs below the engine: with every core computing the step (serve's default), an equal share
# for a long compile slows every tenant's step; at nice 10 it gets ~10% of a core the step also wants
# and all of an idle one. Its budget is wall time, so a busy server refuses a huge grammar sooner.
WORKER_NICE = 10


def _below_the_engine() -> None:
    """A grammar worker's start: its own thread's nice value, WORKER_NICE above the process's (Linux sets
    it per thread id)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))
    except (AttributeError, OSError):  # not Linux, or not allowed: equal share
        pass


def _request_key(namespace: str, params: StructuredOutputsParams) -> tuple[str, str]:
    """Cheap on the event loop (a few ms for a 400 KB schema; asdict's deep copy took 48)."""
    fields = [getattr(params, f.name) for f in dataclasses.fields(params)]
    return namespace, json.dumps(fields, default=str)


class GrammarWorkers:
    def __init__(self, budget_s: float = DEFAULT_BUDGET_S, num_workers: int = NUM_WORKERS) -> None:
        assert num_workers > MAX_PER_TENANT, "one tenant must never hold every worker"
        if budget_s <= 0:
            raise ValueError(f"the grammar compile budget must be positive, got {budget_s}")
        self.budget_s = budget_s
        self.pool = ThreadPoolExecutor(num_workers, thread_name_prefix="kvserve-grammar",
                                       initializer=_below_the_engine)
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], Future] = {}
        self._timed_out: OrderedDict[tuple[str, str], GrammarError] = OrderedDict()

    async def compile(self, compile_fn: Callable[[StructuredOutputsParams, str], Any],
                      params: StructuredOutputsParams, namespace: str) -> Any:
        """compile_fn(params, namespace) on a worker thread; its result, or GrammarError (its own,
        or the budget's)."""
        key = _request_key(namespace, params)
        with self._lock:
            if key in self._timed_out:
                raise self._timed_out[key]
            future = self._in_flight.get(key)
            is_new = future is None
            if is_new and sum(k[0] == namespace for k in self._in_flight) >= MAX_PER_TENANT:
                raise GrammarError(f"this API key already has {MAX_PER_TENANT} constraints compiling; "
                                   "retry when they are done", params.field)
            if is_new:
                future = self.pool.submit(compile_fn, params, namespace)
                self._in_flight[key] = future
        if is_new:  # (outside the lock: a future already done runs the callback here and now)
            future.add_done_callback(lambda _: self._forget(key))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.budget_s)
        except asyncio.TimeoutError:
            error = GrammarError(f"the constraint did not compile within {self.budget_s:g} s "
                                 "(--grammar-compile-timeout); simplify it", params.field)
            with self._lock:  # final for this tenant and constraint, even if the compile ends later
                self._timed_out[key] = error
                while len(self._timed_out) > MAX_REMEMBERED_TIMEOUTS:
                    self._timed_out.popitem(last=False)
            raise error from None

    def _forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._in_flight.pop(key, None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
