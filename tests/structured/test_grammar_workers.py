"""GrammarWorkers: compiles run on worker threads, identical requests of one tenant share one compile,
a compile past the budget is a GrammarError naming the flag, for its retries too, at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvserve.structured import GrammarError, StructuredOutputsParams
from kvserve.structured.workers import GrammarWorkers


class SlowCompiler:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls, self.threads = seconds, 0, set()

    def __call__(self, params, namespace):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        return ("compiled", namespace)


PARAMS = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}, field="response_format")


def test_identical_requests_share_one_compile_off_the_loop_thread():
    workers, compiler = GrammarWorkers(budget_s=5), SlowCompiler(0.2)

    async def main():
        return await asyncio.gather(*(workers.compile(compiler, PARAMS, "a") for _ in range(5)),
                                    workers.compile(compiler, PARAMS, "b"))

    results = asyncio.run(main())
    assert results == [("compiled", "a")] * 5 + [("compiled", "b")]
    assert compiler.calls == 2  # one per tenant
    assert all(name.startswith("kvserve-grammar") for name in compiler.threads)
    # a compile already done when the next request comes: a new compile (the compiler's own cache
    # is what answers repeats), and no deadlock on the finished future
    assert asyncio.run(workers.compile(compiler, PARAMS, "a")) == ("compiled", "a")
    workers.shutdown()


def test_past_the_budget_a_grammar_error_and_its_retry_is_refused_at_once():
    workers, compiler = GrammarWorkers(budget_s=0.3), SlowCompiler(1.5)
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="--grammar-compile-timeout") as err:
        asyncio.run(workers.compile(compiler, PARAMS, "a"))
    assert err.value.field == "response_format"
    assert time.perf_counter() - start < 1.2
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
        asyncio.run(workers.compile(compiler, PARAMS, "a"))
    assert time.perf_counter() - start < 0.2 and compiler.calls == 1
    workers.shutdown()


def test_one_tenant_holds_at_most_its_share_of_the_workers():
    from kvserve.structured.workers import MAX_PER_TENANT

    workers, compiler = GrammarWorkers(budget_s=0.1), SlowCompiler(1.0)
    others = [StructuredOutputsParams(regex=f"a{i}", field="regex") for i in range(MAX_PER_TENANT + 1)]
    for params in others[:MAX_PER_TENANT]:  # past the budget, still running
        with pytest.raises(GrammarError, match="did not compile"):
            asyncio.run(workers.compile(compiler, params, "a"))
    with pytest.raises(GrammarError, match="already has"):
        asyncio.run(workers.compile(compiler, others[-1], "a"))
    assert compiler.calls == MAX_PER_TENANT
    assert asyncio.run(workers.compile(lambda p, ns: "ok", others[-1], "b")) == "ok"  # b is not held up
    workers.shutdown()


def test_compiles_run_below_the_engine_threads_priority():
    """a compile's thread is niced by WORKER_NICE: on a busy host the step keeps its cores"""
    import os

    from kvserve.structured.workers import WORKER_NICE

    workers = GrammarWorkers(budget_s=5)
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def own_nice(params, namespace):
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert asyncio.run(workers.compile(own_nice, PARAMS, "a")) == min(19, engine_nice + WORKER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == engine_nice  # the caller's own is unchanged
    workers.shutdown()
