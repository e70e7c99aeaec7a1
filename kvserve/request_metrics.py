"""vLLM's per-request and per-step histograms, with vLLM's buckets: queue, prefill, decode and
inference time, prompt and generation lengths, inter-token latency and tokens per engine step
(vllm/v1/metrics/loggers.py). metrics.EngineMetrics feeds them from the engine loop."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram

from kvserve.engine_stats import EngineStats
from kvserve.request import RequestOutput

# vLLM's request_latency_buckets (e2e, queue, prefill, decode, inference) and its TPOT/ITL buckets
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# name -> help; the phases as vLLM splits a request: queued | prefill (to the first token) | decode
PHASES = {
    "request_queue_time_seconds": "Time from arrival to the first step that computed the request.",
    "request_prefill_time_seconds": "Time from the first scheduled step to the first token.",
    "request_decode_time_seconds": "Time from the first token to the last.",
    "request_inference_time_seconds": "Time from the first scheduled step to the last token.",
}


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets over max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class RequestHistograms:
    def __init__(self, prefix: str, labels: list[str], base: tuple[str, ...], max_model_len: int,
                 registry: CollectorRegistry) -> None:
        def histogram(name: str, help_: str, buckets) -> Histogram:
            return Histogram(prefix + name, help_, labels, buckets=buckets, registry=registry).labels(*base)

        self.phases = {name: histogram(name, help_, REQUEST_LATENCY_BUCKETS) for name, help_ in PHASES.items()}
        lengths = buckets_1_2_5(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.", lengths)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per finished request.",
                                           lengths)
        self.inter_token = histogram("inter_token_latency_seconds", "Time between a request's successive "
                                     "tokens (one observation per request per step).", TOKEN_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_TOKENS_BUCKETS)
        self._last_token_at: dict[str, float] = {}  # request id -> when its previous step's token came
        self._steps_seen = self._step_tokens_seen = 0

    def start_after(self, num_steps: int, num_step_tokens: int) -> None:
        """Collectors attached to an engine that has run already: its steps so far are not ours."""
        self._steps_seen, self._step_tokens_seen = num_steps, num_step_tokens

    def observe_step(self, stats: EngineStats, outputs: Iterable[RequestOutput]) -> None:
        # called after every step, so one new step is this step (idle calls see none)
        if stats.num_steps - self._steps_seen == 1:
            self.iteration_tokens.observe(stats.num_step_tokens - self._step_tokens_seen)
        self._steps_seen, self._step_tokens_seen = stats.num_steps, stats.num_step_tokens
        now = time.monotonic()
        for output in outputs:
            last = self._last_token_at.pop(output.request_id, None)
            if last is not None:
                self.inter_token.observe(now - last)
            if not output.finished:
                self._last_token_at[output.request_id] = now

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        if m.first_scheduled_time is None or m.first_token_time is None or m.finish_time is None:
            return  # (aborted before it ran)
        spans = {"request_queue_time_seconds": m.first_scheduled_time - m.arrival_time,
                 "request_prefill_time_seconds": m.first_token_time - m.first_scheduled_time,
                 "request_decode_time_seconds": m.finish_time - m.first_token_time,
                 "request_inference_time_seconds": m.finish_time - m.first_scheduled_time}
        for name, seconds in spans.items():
            self.phases[name].observe(max(seconds, 0.0))
