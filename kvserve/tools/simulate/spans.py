"""What-if for a hidden span (cache/spans.py finds them): the trace with the span moved first."""

from __future__ import annotations

from dataclasses import replace

from kvserve.cache.spans import HiddenSpan
from kvserve.tools.simulate.requests import SimRequest


def move_span_to_front(requests: list[SimRequest], span: HiddenSpan) -> list[SimRequest]:
    """The trace as it would be if each request sent the span first and its own header after it."""
    out = []
    for i, r in enumerate(requests):
        tokens = r.token_ids
        if i in span.starts:
            s, e = span.starts[i], span.starts[i] + span.length
            tokens = tokens[s:e] + tokens[:s] + tokens[e:]
        out.append(replace(r, token_ids=tokens))
    return out

