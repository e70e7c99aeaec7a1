"""`kvserve bench`'s memory wall: the bytes a single-stream decode token reads come from the GGUF's own
tensor sizes plus the context's KV, and each engine's GB/s is those bytes over its time per token."""

from __future__ import annotations

import gguf
import pytest

from kvserve.config import EngineConfig, kv_bytes_for_tokens, resolve_kv_dtype
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from kvserve.tools.bench import memory_wall


def test_a_decode_token_reads_every_matrix_and_its_context_kv():
    path = bundled_model_path()
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    need = memory_wall.decode_bytes(path, {}, context=1000)
    matrices = sum(v for k, v in tensors.items() if not k.endswith("norm.weight"))
    # the bundled model ties its embedding to the lm_head: the whole table is read every token
    assert "output.weight" not in tensors and need.weights == matrices
    config = EngineConfig(model=path)
    expected_kv = kv_bytes_for_tokens(load_gguf(path).config, resolve_kv_dtype(config.kv_cache_dtype, config.dtype),
                                      1000, 1)
    assert need.kv == expected_kv > 0 and need.total == need.weights + need.kv


def test_each_engine_is_a_fraction_of_the_probed_bandwidth(monkeypatch):
    monkeypatch.setattr(memory_wall, "read_bandwidth_gbs", lambda threads: 20.0)
    wall = memory_wall.memory_wall(bundled_model_path(), {}, 1500, 2,
                                   {"kvserve": {"tpot_s": 0.01}, "llama-cpp": {"tpot_s": 0.02}, "slow": {"tpot_s": None}})
    ours, peer = wall["engines"]["kvserve"], wall["engines"]["llama-cpp"]
    assert ours["achieved_gbs"] == pytest.approx(wall["bytes_per_token"] / 0.01 / 1e9)
    assert ours["fraction_of_host"] == pytest.approx(ours["achieved_gbs"] / 20.0)
    assert peer["achieved_gbs"] == pytest.approx(ours["achieved_gbs"] / 2) and "slow" not in wall["engines"]


def test_the_probe_reads_at_a_plausible_rate():
    assert 0.5 < memory_wall.read_bandwidth_gbs(1, repeats=2) < 1000


@pytest.mark.parametrize("before, after", [(30.0, 20.0), (20.0, 30.0)])
def test_the_best_probe_of_the_run_counts(monkeypatch, before, after):
    # a neighbour's burst during one probe must not put an engine above the host's bandwidth
    monkeypatch.setattr(memory_wall, "read_bandwidth_gbs", lambda threads: after)
    wall = memory_wall.memory_wall(bundled_model_path(), {}, 1500, 2, {"kvserve": {"tpot_s": 0.01}},
                                   earlier_probes=(before,))
    assert wall["host_read_gbs"] == 30.0 and wall["host_read_samples_gbs"] == [before, after]
    assert wall["engines"]["kvserve"]["fraction_of_host"] == pytest.approx(
        wall["engines"]["kvserve"]["achieved_gbs"] / 30.0)
