"""AsyncEngine: the engine loop on a background thread, serving asyncio callers; RequestStream: the
outputs of one request as an async iterator."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvserve.engine import LLMEngine, Prompt
from kvserve.structured.workers import GrammarWorkers
from kvserve.engine_stats import EngineStats
from kvserve.request import CacheLease, RequestOutput, ToolCallKV
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop failed while this request was in it; the request was aborted."""


class RequestStream:
    """The outputs of one request, as an async iterator. Outputs are cumulative (token ids and text
    so far), so a consumer that falls behind gets only the newest one: nothing is lost."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncEngine:
    """Runs `LLMEngine.step()` in a background thread (torch releases the GIL while it computes)
    and serves any number of asyncio event loops.

    Everything that touches the engine runs on that thread: `add_request`, `abort` and `call` post
    commands that it executes between steps; outputs go back to each request's `RequestStream`
    through its loop's `call_soon_threadsafe`. An exception in a step aborts the requests then in
    the engine (their streams raise `EngineDeadError`) and the loop goes on serving new ones.
    `on_step(stats, outputs)` is called on the engine thread after each step (metrics).
    """

    def __init__(self, engine: LLMEngine,
                 on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.latest_stats: EngineStats | None = None  # the last read (dashboard, admission); None before it
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # structured outputs are compiled here, before a request reaches the engine thread
        self._grammar_workers: GrammarWorkers | None = None  # made on the first constraint

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._publish([])
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None
        if self._grammar_workers is not None:
            self._grammar_workers.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_requests_running(self) -> int:
        """As of the last stats read (0 before it): what the server's admission counts against."""
        return self.latest_stats.scheduler.num_requests_running if self.latest_stats is not None else 0

    # -- requests ------------------------------------------------------------------------------
    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None, namespace: str = "",
                          leases: list[CacheLease] | None = None, kv_explain: bool = False,
                          tool_call: ToolCallKV | None = None) -> RequestStream:
        """Queue a request; raises the engine's ValueError for bad input. Iterate the returned
        stream for outputs; `abort(stream.request_id)` if you stop before it finishes. `leases`:
        cache breakpoints (granted when the prompt is computed; see RequestOutput.lease_usage)."""
        return (await self.add_requests([(prompt, params, request_id)], namespace, leases, kv_explain,
                                        tool_call))[0]

    async def add_requests(self, items: list[tuple[Prompt, SamplingParams | None, str | None]],
                           namespace: str = "", leases: list[CacheLease] | None = None,
                           kv_explain: bool = False, tool_call: ToolCallKV | None = None
                           ) -> list[RequestStream]:
        """Queue several requests in one trip to the engine thread, all or none: if one is bad,
        none stays queued and its ValueError is raised."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        grammars = [await self._compiled_grammar(params, namespace) for _, params, _ in items]
        streams = [RequestStream(rid or f"async-{next(self._ids)}", loop) for _, _, rid in items]

        def add() -> None:
            added: list[str] = []
            try:
                for (prompt, params, _), stream, compiled in zip(items, streams, grammars):
                    extra = {} if compiled is None else {"compiled_grammar": compiled}
                    self.engine.add_request(prompt, params, request_id=stream.request_id,
                                            tenant=namespace, leases=leases, kv_explain=kv_explain,
                                            tool_call=tool_call, **extra)
                    added.append(stream.request_id)
            except Exception:
                for request_id in added:
                    self.engine.abort(request_id)
                raise
            for stream in streams:
                self._streams[stream.request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            for stream in streams:  # the caller went away while its requests were being queued
                self.abort(stream.request_id)
            raise
        return streams

    async def _compiled_grammar(self, params: SamplingParams | None, namespace: str):
        """The request's structured-outputs constraint compiled on a grammar worker within its
        budget (None without one); GrammarError (a ValueError, a 400) if it cannot be."""
        if params is None or params.structured_outputs is None:
            return None
        engine = self.engine
        if self._grammar_workers is None:
            self._grammar_workers = GrammarWorkers(engine.config.grammar_compile_timeout)
        return await self._grammar_workers.compile(
            lambda p, ns: engine.grammar_compiler().compile(p, ns), params.structured_outputs, namespace)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, namespace: str = ""
                       ) -> AsyncIterator[RequestOutput]:
        """Async iterator of cumulative RequestOutputs; the request is aborted (its pages freed)
        if the iteration is abandoned or cancelled before it finishes."""
        stream = await self.add_request(prompt, params, request_id, namespace)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe, non-blocking; the stream (if still read) ends with an aborted output."""
        self._commands.put(lambda: self._abort(request_id))

    def abort_all(self, reason: str) -> None:
        """Thread-safe, non-blocking: abort every request (shutdown). Each stream ends with its
        aborted output (finish_reason "abort"); every page goes back to the pool."""
        self._commands.put(lambda: self._abort_all(reason))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result, error = fn(), None
            except Exception as err:  # handed to the caller, never kills the loop
                result, error = None, err
            loop.call_soon_threadsafe(_resolve, future, result, error)

        self._commands.put(run)
        return await future

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._run_commands(block=not self.engine.has_unfinished())
                if self._stopping or not self.engine.has_unfinished():
                    continue
                outputs = self.engine.step()
                self._deliver(outputs)
                self._publish(outputs)
            except Exception as err:  # one bad request or step must not stop the server
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(f"the engine failed while running this request: {err}")
        self._fail_all("the server is shutting down")

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                self.engine.expire_leases()  # (an idle server's leases run out too)
                self._publish([])  # idle: keep stats fresh (e.g. cached pages evicted elsewhere)
            return
        while True:
            if command is None:
                return
            try:
                command()
            except Exception:  # a failed abort must not take the other requests with it
                log.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver([output])
            self._publish([output])
        else:
            self._streams.pop(request_id, None)

    def _abort_all(self, reason: str) -> None:
        for request_id, stream in list(self._streams.items()):
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver([output])
            elif self._streams.pop(request_id, None) is not None:  # nothing left to abort
                try:
                    stream.loop.call_soon_threadsafe(_put_all, [(stream, EngineDeadError(reason))])
                except RuntimeError:
                    pass
        for request_id in list(self.engine.scheduler.requests):  # requests nobody streams
            self.engine.abort(request_id)
        self._publish([])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for output in outputs:
            stream = (self._streams.pop(output.request_id, None) if output.finished
                      else self._streams.get(output.request_id))
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                for stream, _ in items:
                    self._commands.put(lambda rid=stream.request_id: self._abort(rid))

    def _fail_all(self, message: str) -> None:
        error = EngineDeadError(message)
        for request_id in list(self.engine.scheduler.requests):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("could not abort %s", request_id)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(_put_all, [(stream, error)])
            except RuntimeError:
                pass
        self._publish([])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        try:
            stats = self.engine.stats()
        except Exception:
            log.exception("engine.stats() failed")
            return
        self.latest_stats = stats
        if self.on_step is not None:
            try:
                self.on_step(stats, outputs)
            except Exception:
                log.exception("on_step callback failed")

    # -- observability -------------------------------------------------------------------------
    def page_states(self) -> str:
        """One character per page (cache.pages.PAGE_*).
        Call it on the engine thread (`call`)."""
        return self.engine.manager.page_states()


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
