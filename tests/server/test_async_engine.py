"""AsyncEngine over a stand-in engine (no model): outputs stream per request, bad input raises
before anything is queued, an abandoned request is aborted, and a step that fails aborts the
requests then in flight while the loop keeps serving new ones."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kvserve.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine_stats import EngineStats
from kvserve.request import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import SchedulerCounts


class StandInEngine:
    """One token per step per request; the prompt "boom" makes the next step raise."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(requests={})
        self.manager = SimpleNamespace()
        self.aborted: list[str] = []

    def add_request(self, prompt, params=None, request_id=None, tenant="", leases=None, kv_explain=False,
                    tool_call=None, grammar=None):
        if not prompt:
            raise ValueError("the prompt is empty")
        if request_id in self.scheduler.requests:
            raise ValueError("request id in use")
        params = params or SamplingParams()
        self.scheduler.requests[request_id] = {"prompt": prompt, "tokens": [], "max": params.max_tokens}
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    def step(self) -> list[RequestOutput]:
        if any(r["prompt"] == "boom" for r in self.scheduler.requests.values()):
            raise RuntimeError("kernel exploded")
        outputs = []
        for rid, r in list(self.scheduler.requests.items()):
            r["tokens"].append(len(r["tokens"]))
            done = len(r["tokens"]) >= r["max"]
            outputs.append(self._output(rid, r, "length" if done else None))
            if done:
                del self.scheduler.requests[rid]
        return outputs

    def abort(self, request_id):
        r = self.scheduler.requests.pop(request_id, None)
        if r is None:
            return None
        self.aborted.append(request_id)
        return self._output(request_id, r, "abort")

    def stats(self):
        return EngineStats(scheduler=SchedulerCounts(num_requests_running=len(self.scheduler.requests)))

    @staticmethod
    def _output(rid, r, reason):
        text = "".join(chr(97 + t % 26) for t in r["tokens"])
        return RequestOutput(rid, None, [1], [CompletionOutput(0, list(r["tokens"]), text, reason)],
                             reason is not None, 0, RequestMetrics(0.0, None, None))


@pytest.fixture
def engine():
    stand_in = StandInEngine()
    async_engine = AsyncEngine(stand_in).start()
    yield async_engine
    async_engine.shutdown()


def test_outputs_stream_until_finished(engine):
    async def run():
        return [o.outputs[0].text async for o in engine.generate("hi", SamplingParams(max_tokens=4))]

    texts = asyncio.run(run())
    assert texts[-1] == "abcd" and all("abcd".startswith(t) for t in texts)


def test_bad_input_raises_and_queues_nothing(engine):
    async def run():
        with pytest.raises(ValueError, match="empty"):
            await engine.add_requests([("ok", None, "a"), ("", None, "b")])
    asyncio.run(run())
    assert engine.engine.scheduler.requests == {} and engine.engine.aborted == ["a"]


def test_an_abandoned_request_is_aborted(engine):
    async def run():
        outputs = engine.generate("hi", SamplingParams(max_tokens=10_000), request_id="gone")
        async for _ in outputs:
            break
        await outputs.aclose()
        for _ in range(100):
            if "gone" in engine.engine.aborted:
                return
            await asyncio.sleep(0.01)
    asyncio.run(run())
    assert engine.engine.aborted == ["gone"]


def test_a_failing_step_aborts_the_requests_in_flight_and_the_loop_goes_on(engine):
    async def run():
        victim = await engine.add_request("fine", SamplingParams(max_tokens=10_000), "victim")
        await engine.add_request("boom", None, "bomb")
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            async for _ in victim:
                pass
        return [o.outputs[0].text async for o in engine.generate("again", SamplingParams(max_tokens=2))]

    assert asyncio.run(run())[-1] == "ab"
    assert engine.is_running


def test_event_loops_in_several_threads_are_served(engine):
    results: list[str] = []

    def client(i: int) -> None:
        async def run():
            async for o in engine.generate("hi", SamplingParams(max_tokens=3 + i)):
                last = o
            results.append(last.outputs[0].text)
        asyncio.run(run())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == ["abc", "abcd", "abcde", "abcdef"]
