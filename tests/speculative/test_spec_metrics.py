"""The speculative decoding counters on /metrics under vLLM's names, and on the dashboard's JSON."""

from __future__ import annotations

from kvserve.engine_stats import EngineStats
from kvserve.metrics import EngineMetrics
from kvserve.server.api import dashboard_payload
from kvserve.speculative.policy import SpecDecodeStats


def test_spec_decode_counters_use_vllms_names():
    metrics = EngineMetrics("m")
    metrics.observe(EngineStats(spec_decode=SpecDecodeStats(3, 10, 6, [3, 2, 1])))
    metrics.observe(EngineStats(spec_decode=SpecDecodeStats(4, 14, 7, [4, 2, 1])))
    text = metrics.render().decode()
    assert 'kvserve:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 14.0' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text


def test_the_dashboard_gets_the_acceptance_counts():
    payload = dashboard_payload(EngineStats(spec_decode=SpecDecodeStats(2, 8, 5, [2, 2, 1])), None, "m")
    assert (payload["spec_decode_num_draft_tokens"], payload["spec_decode_num_accepted_tokens"]) == (8, 5)
