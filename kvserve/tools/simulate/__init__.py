"""`kvserve simulate`: replay a trace through the server's own Scheduler and KVCacheManager (a virtual
clock instead of the model) and explain the hit rate: what each policy, page size and capacity
achieves, what was attainable, and why tokens that repeat across requests were missed.

    requests.py  trace -> SimRequest (token ids, namespace, arrival), replay order
    replayer.py  one replay: Scheduler + KVCacheManager stepped on a virtual clock -> RunResult
    ideals.py    what an unbounded cache could hit, per policy and page size
    spans.py     diagnosis: repeated spans no prefix cache can see
    analysis.py  the report: runs, radix vs hash, diagnosis, recommended capacity
    cli.py       flags and `main_simulate`;  render.py  the rich report
"""

from kvserve.tools.simulate.analysis import POLICIES, analyze, capacity_for, compare_runs
from kvserve.tools.simulate.cli import add_simulate_arguments, main_simulate
from kvserve.tools.simulate.ideals import Ideals, compute_ideals, short_prefixes
from kvserve.tools.simulate.render import render_simulation
from kvserve.tools.simulate.replayer import (GENERATED_ID_BASE, RunResult, SchedulerLimits, ServiceModel,
                                           VirtualClock, replay)
from kvserve.tools.simulate.requests import SimRequest, prepare, unbounded_pages
from kvserve.cache.spans import HiddenSpan, find_hidden_spans
from kvserve.tools.simulate.spans import move_span_to_front

__all__ = ["GENERATED_ID_BASE", "POLICIES", "HiddenSpan", "Ideals", "RunResult", "SchedulerLimits", "ServiceModel",
           "SimRequest", "VirtualClock", "add_simulate_arguments", "analyze", "capacity_for", "compare_runs",
           "compute_ideals", "find_hidden_spans", "main_simulate", "move_span_to_front", "prepare", "render_simulation",
           "replay", "short_prefixes", "unbounded_pages"]
