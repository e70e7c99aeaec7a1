"""A closed-loop workload (the agent trace) through LLMEngine, as its clients send it: a request goes in
at its arrival, or its delay after the request it follows finishes (a tool's latency, a user's think
time); a follow-up resends the conversation it continues (that request's prompt and output, then its
own tokens). A tool call's answer is forced by a JSON-schema grammar over the call object, as the
server forces `tool_choice: "required"`, and goes in with the ToolCallKV the server gives the engine: hold
this answer's KV, end the hold of the call whose result it brings. Reported beside the usual figures:
follow-up hit rate and TTFT, failures, and the pages still in use when it is over (with every lease
released the pool must be full again: `pages_leaked` 0; cli.py exits 1 otherwise).

The workload sized for this (`--workload agent-small --limit 30`, 2 agents, 4 follow-ups, on a
3,072-token pool with `--max-leased-fraction 0.85 --tool-call-kv-ttl 90 --swap-space 0
--max-num-batched-tokens 256`, the same flags for both engines) and why: docs/simulate.md, "The agent
bench"."""

from __future__ import annotations

import heapq
import time
from collections import defaultdict

from kvserve.tools.bench.figures import percentile
from kvserve.tools.bench.spec import Reporter, RunSpec, wait_until

# The call an agent's model writes: one of a few tools, with short arguments (fixed separators, closed
# objects: it ends itself, well inside the trace's max_tokens for a call).
CALL_SCHEMA = {
    "type": "object", "required": ["name", "arguments"], "additionalProperties": False,
    "properties": {
        "name": {"enum": ["read_file", "search_code", "run_tests", "edit_file", "list_dir"]},
        "arguments": {"type": "object", "required": ["path"], "additionalProperties": False,
                      "properties": {"path": {"type": "string", "maxLength": 24}}}}}


def run_loops(engine, spec: RunSpec, report: Reporter) -> dict:
    """Run the workload on a warmed-up engine; returns the per-request results and the agent figures."""
    from kvserve.request import ToolCallKV
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured import StructuredOutputsParams

    loops, n = spec.loops, len(spec.token_ids)
    call = StructuredOutputsParams(json=CALL_SCHEMA, strict=True, field="bench tool call")
    children: dict[int, list[int]] = defaultdict(list)
    for i, parent in enumerate(loops.after):
        if parent is not None:
            children[parent].append(i)
    due = [(loops.arrivals[i], i) for i in range(n) if loops.after[i] is None]  # (seconds after t0, index)
    heapq.heapify(due)
    prompts: dict[int, list[int]] = {}
    outs: dict[int, object] = {}
    failed: dict[int, str] = {}
    generated = engine.scheduler.stats.generation_tokens

    def fail(i: int, why: str) -> None:
        """Never sent or refused, and so are the lines that would follow it."""
        failed[i] = why
        for c in children[i]:
            fail(c, f"follows a failed request ({why})")

    def submit(i: int) -> None:
        prompt, answers = list(spec.token_ids[i]), ()
        if loops.continues[i]:
            parent = outs[loops.after[i]]
            prompt = prompts[loops.after[i]] + list(parent.outputs[0].token_ids) + prompt
            answers = (parent.held_lease_id,) if parent.held_lease_id else ()
        prompts[i] = prompt
        tool = loops.tool_call[i]
        params = SamplingParams(max_tokens=spec.max_tokens[i], temperature=0.0, ignore_eos=not tool,
                                structured_outputs=call if tool else None)
        try:
            engine.add_request({"prompt_token_ids": prompt}, params, f"r{i}",
                               tool_call=ToolCallKV(hold=tool, answers=answers) if tool or answers else None)
        except ValueError as err:
            fail(i, str(err))

    peak_pages, t0 = 0, time.monotonic()
    while due or engine.has_unfinished():
        if due and not engine.has_unfinished():
            wait_until(t0 + due[0][0])
        while due and time.monotonic() >= t0 + due[0][0]:
            submit(heapq.heappop(due)[1])
        if not engine.has_unfinished():
            continue
        for out in engine.step():
            if out.finished:
                i = int(out.request_id[1:])
                outs[i] = out
                if out.outputs[0].finish_reason == "abort":
                    fail(i, "aborted")
                    continue
                for c in children[i]:
                    heapq.heappush(due, (time.monotonic() - t0 + loops.delay_s[c], c))
        peak_pages = max(peak_pages, engine.manager.num_used_pages)
        report.tokens(engine.scheduler.stats.generation_tokens - generated)
    wall = time.monotonic() - t0
    return {"wall_s": wall, "peak_pages": peak_pages, "prompt_tokens_sent": sum(map(len, prompts.values())),
            "requests": [{"output_token_ids": list(o.outputs[0].token_ids), "ttft_s": o.metrics.ttft_s,
                          "e2e_s": o.metrics.e2e_s, "cached_tokens": o.num_cached_tokens}
                         for o in (outs[i] for i in range(n) if i in outs)],
            "agent": _agent_figures(engine, loops, prompts, outs, failed)}


def _agent_figures(engine, loops, prompts: dict, outs: dict, failed: dict) -> dict:
    follow = [i for i in outs if loops.continues[i]]
    ttft = [outs[i].metrics.ttft_s for i in follow]
    prompt = sum(len(prompts[i]) for i in follow)
    calls = [i for i in outs if loops.tool_call[i]]
    leases = engine.stats().cache.leases
    in_use, num_leases = engine.manager.num_used_pages, len(engine.manager.leases.leases)
    engine.manager.check_invariants()
    for lease_id in list(engine.manager.leases.leases):  # holds no follow-up came for (none, normally)
        engine.manager.leases.release(lease_id)
    return {"tool_call_kv_ttl": engine.config.tool_call_kv_ttl, "num_follow_ups": len(follow),
            "follow_up_hit_rate": sum(outs[i].num_cached_tokens for i in follow) / prompt if prompt else None,
            "follow_up_ttft_p50_s": percentile(ttft, 50), "follow_up_ttft_p95_s": percentile(ttft, 95),
            "num_tool_calls": len(calls),
            "num_calls_unfinished": sum(outs[i].outputs[0].finish_reason != "stop" for i in calls),
            "tool_call_holds_granted": leases.tool_call_lease_grants,
            "tool_call_holds_used": leases.tool_call_lease_used,
            "holds_refused": sorted({str(outs[i].hold_refused) for i in calls if outs[i].hold_refused}),
            "num_failed": len(failed), "failures": sorted(set(failed.values()))[:3],
            "pages_in_use_at_end": in_use, "leases_at_end": num_leases,
            "pages_leaked": engine.manager.pool.num_used,  # with every lease released: must be 0
            "pool_free_pages_at_end": engine.manager.pool.num_free, "pool_pages": engine.manager.pool.num_usable}
