"""`kvserve bench`: the figures, ratios and agreement from per-request results; workload resolution;
and tiny end-to-end runs (kvserve alone, beside transformers, and over HTTP: kvserve serve with
concurrent streaming clients, cold and warm passes, beside llama-server) with stable JSON keys and a PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve import kernels
from kvserve.cli import main
from kvserve.config import ConfigError
from kvserve.tools.bench import (ENGINE_KEYS, RATIO_KEYS, agreement, load_workload, percentile, plot, ratios,
                                 shared_prefix_len, summarize, workloads_dir)
from kvserve.tools.bench.http_client import token_counts
from kvserve.tools.bench.http_mode import (kv_capacity_tokens, kvserve_label_for, llama_server_context, pass_labels,
                                           same_slots_kwargs)
from kvserve.tools.bench.servers import llama_server_path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT_KEYS = {"schema_version", "workload", "machine", "engine_args", "engines", "ratios", "greedy_agreement"}
SMALL_POOL = ["--kv-cache-memory", "64MiB", "--max-model-len", "256"]


def raw_result(ttfts, cached, wall=10.0, tokens=4):
    requests = [{"output_token_ids": list(range(tokens)), "ttft_s": t, "e2e_s": t + 0.1 * (tokens - 1),
                 "cached_tokens": c} for t, c in zip(ttfts, cached)]
    return {"requests": requests, "wall_s": wall, "prompt_tokens": 100, "prefix_hit_rate": 0.5,
            "peak_rss_bytes": 2**30, "kv_bytes": 2**20, "kv_bytes_used_peak": 2**19, "load_s": 1.0, "threads": 2}


def tiny_trace(tmp_path, num_requests=3, max_tokens=3):
    prefix = list(range(400, 440))  # 40 shared tokens, then 8 distinct ones per request
    lines = [{"id": f"t{i}", "prompt_token_ids": prefix + list(range(1000 + 10 * i, 1008 + 10 * i)),
              "max_tokens": max_tokens} for i in range(num_requests)]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    values = [0.3, 1.0, 0.1, 7.5, 2.0, 2.2]
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_summary_has_the_stable_keys_and_splits_cached_from_cold():
    fig = summarize(raw_result([1.0, 0.2, 0.3, 0.4], [0, 32, 32, 32], wall=8.0))
    assert tuple(fig) == ENGINE_KEYS
    assert fig["output_tokens"] == 16 and fig["output_tokens_per_s"] == pytest.approx(2.0)
    assert fig["total_tokens_per_s"] == pytest.approx(116 / 8)
    assert fig["tpot_s"] == pytest.approx(0.1)
    assert (fig["num_cached_requests"], fig["num_cold_requests"]) == (3, 1)
    assert fig["ttft_cold_p95_s"] == 1.0 and fig["ttft_cached_p95_s"] == pytest.approx(0.39)
    assert fig["ttft_cached_over_cold_p95"] == pytest.approx(0.39)


def test_ratios_are_kvserve_over_peer_with_speedup():
    ours, peer = summarize(raw_result([1, 2], [0, 5], wall=5.0)), summarize(raw_result([2, 4], [0, 0], wall=20.0))
    peer["prefix_hit_rate"] = 0.0
    r = ratios(ours, peer)
    assert set(r) == set(RATIO_KEYS) | {"speedup"}
    assert r["wall_s"] == pytest.approx(0.25) and r["speedup"] == pytest.approx(4.0)
    assert r["output_tokens_per_s"] == pytest.approx(4.0) and r["ttft_p50_s"] == pytest.approx(0.5)
    assert r["prefix_hit_rate"] is None  # no ratio against zero


def test_agreement_counts_identical_requests():
    a = agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert (a["identical_requests"], a["fraction"]) == (1, 0.5)
    assert a["mean_common_prefix_frac"] == pytest.approx((1 + 1 / 3) / 2)


def test_workloads_resolve_to_token_ids(tmp_path):
    rag = load_workload("rag", limit=5, max_tokens=7)
    assert len(rag.token_ids) == 5 and rag.max_tokens == [7] * 5 and rag.source.startswith("generated:rag")
    trace = load_workload(str(tiny_trace(tmp_path)))
    assert trace.max_tokens == [3, 3, 3] and shared_prefix_len(trace.token_ids) == 40
    assert trace.describe()["shared_prefix_tokens"] == 40
    with pytest.raises(ConfigError, match="unknown workload"):
        load_workload("nope")
    with pytest.raises(ConfigError, match="--limit"):
        load_workload("rag", limit=0)


@pytest.mark.skipif(not (workloads_dir() / "w1.jsonl").is_file(), reason="../shared/workloads/w1.jsonl absent")
def test_w1_is_the_shared_file():
    w1 = load_workload("w1", limit=2, max_tokens=4)
    assert w1.source.endswith("w1.jsonl") and w1.request_ids == ["w1-00", "w1-01"]
    assert shared_prefix_len(w1.token_ids) > 1000 and w1.max_tokens == [4, 4]


def test_missing_llama_cpp_is_one_line(capsys):
    pytest.importorskip("matplotlib")
    try:
        import llama_cpp  # noqa: F401
        pytest.skip("llama-cpp-python is installed")
    except ImportError:
        pass
    assert main(["bench", "--vs", "llama-cpp", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "llama-cpp-python" in err and "\n" not in err


def test_plot_writes_a_png(tmp_path):
    ours, peer = summarize(raw_result([1, 2], [0, 5])), summarize(raw_result([2, 4], [0, 0]))
    report = {"workload": {"name": "tiny", "num_requests": 2}, "machine": {"load_avg_before": [0.5, 0, 0]},
              "engines": {"kvserve": ours, "transformers": peer}}
    plot(report, str(tmp_path / "out.png"))
    assert (tmp_path / "out.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_tiny_run_beside_transformers(tmp_path, capsys):
    """On a tiny Qwen2 GGUF (2,048 tokens, 2 layers): transformers parses a GGUF's vocabulary in Python,
    ~10 s a load for the bundled model's 49,152 tokens, and each peer loads it in its own process."""
    from tests.model.tiny_models import make_hf_model, write_gguf

    model = write_gguf(make_hf_model("qwen2"), "qwen2", tmp_path / "tiny.gguf")
    out = tmp_path / "bench.png"
    assert main(["bench", "--model", str(model), "--workload", str(tiny_trace(tmp_path)), "--vs", "transformers",
                 "--json", "--plot", str(out), "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                 "--dtype", "float32"]) == 0
    report = json.loads(capsys.readouterr().out)
    # float32's matrices run on the native kernels where they are built: the report names their tuning
    assert set(report) == REPORT_KEYS | ({"kernels"} if kernels.library() is not None else set())
    peers = ["transformers", "transformers+prompt-cache"]
    assert list(report["engines"]) == ["kvserve", *peers]
    for fig in report["engines"].values():
        assert tuple(fig) == ENGINE_KEYS
        assert fig["output_tokens"] == 9 and fig["wall_s"] > 0 and len(fig["ttft_s"]) == 3
        assert fig["peak_rss_bytes"] > 0 and fig["kv_bytes"] > 0
    for name in peers:
        assert set(report["ratios"][name]) == set(RATIO_KEYS) | {"speedup"}
        ratio = report["ratios"][name]["wall_s"]
        assert ratio == pytest.approx(report["engines"]["kvserve"]["wall_s"] / report["engines"][name]["wall_s"])
        assert report["greedy_agreement"][name]["fraction"] == 1.0  # float32 greedy: same tokens
    assert report["engines"]["transformers+prompt-cache"]["cached_prompt_tokens"] == 3 * 40
    assert out.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_tiny_run_alone_prints_the_table(tmp_path, capsys):
    assert main(["bench", "--workload", str(tiny_trace(tmp_path, 2, 2)), "--vs", "none",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "256"]) == 0
    text = capsys.readouterr().out
    assert "wall time" in text and "TTFT p95" in text and "kvserve" in text
    assert main(["bench", "--workload", str(tiny_trace(tmp_path, 2, 2)), "--vs", "none", "--json",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "256"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["engines"]) == ["kvserve"] and report["ratios"] == {} and report["greedy_agreement"] == {}
    assert report["engines"]["kvserve"]["num_cached_requests"] >= 1  # the second request hits the prefix


def test_a_safetensors_folder_is_benched_without_the_memory_wall(tmp_path, capsys):
    """The wall's bytes a token reads come from a GGUF's tensor sizes; a folder's run still reports."""
    from tests.model.tiny_models import make_hf_model, save_folder

    folder = save_folder(make_hf_model("llama3"), tmp_path / "folder")
    assert main(["bench", "--model", str(folder), "--workload", str(tiny_trace(tmp_path, 1, 3)), "--vs", "none",
                 "--json", *SMALL_POOL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert REPORT_KEYS <= set(report) and "memory_wall" not in report
    assert report["engines"]["kvserve"]["output_tokens"] == 3


# -- over HTTP ------------------------------------------------------------------------------------------
def test_summary_takes_the_servers_token_count_and_unknown_cache():
    raw = raw_result([1.0, 2.0], [None, None])
    for r in raw["requests"]:
        r["num_output_tokens"] = len(r.pop("output_token_ids"))
    fig = summarize(raw)
    assert fig["output_tokens"] == 8 and fig["cached_prompt_tokens"] is None
    assert fig["num_cached_requests"] == fig["num_cold_requests"] == 0  # unknown is neither


def test_token_counts_come_from_usage_then_llama_cpp_timings():
    usage = {"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 40}}
    assert token_counts(usage, None, 3) == (4, 40)
    assert token_counts({"completion_tokens": 4}, {"cache_n": 12, "predicted_n": 4}, 3) == (4, 12)
    assert token_counts(None, {"cache_n": 0, "predicted_n": 5}, 3) == (5, 0)
    assert token_counts(None, None, 3) == (3, None)


def test_passes_are_labelled_cold_then_warm_and_compared_pass_by_pass():
    assert pass_labels("kvserve", 1) == ["kvserve"]
    assert pass_labels("llama-server", 2) == ["llama-server/cold", "llama-server/warm"]
    assert pass_labels("kvserve", 3) == ["kvserve/cold", "kvserve/warm1", "kvserve/warm2"]
    assert kvserve_label_for("llama-server/warm") == "kvserve/warm" and kvserve_label_for("llama-server") == "kvserve"
    assert llama_server_context([[1] * 300, [1] * 10], [64, 64], 4) == 4 * 512  # each slot holds 364 + 16
    assert llama_server_context([[1] * 300], [64], 4, kv_capacity_tokens=46_000) == 46_000  # kvserve's pool
    assert llama_server_context([[1] * 300], [64], 4, kv_capacity_tokens=1_000) == 4 * 512  # slots must fit


def test_beside_llama_server_kvserve_holds_as_many_sequences_as_its_slots():
    assert same_slots_kwargs({"max_num_seqs": 64, "page_size": 16}, 1) == {"max_num_seqs": 1, "page_size": 16}
    assert same_slots_kwargs({"max_num_seqs": 4}, 8) == {"max_num_seqs": 4}  # a smaller --max-num-seqs stays


@pytest.mark.parametrize("prefix", ["kvserve", "vllm"])
def test_kvserve_capacity_is_read_from_its_cache_config_series(prefix):
    from kvserve.metrics import EngineMetrics

    metrics = EngineMetrics("m", prefix=prefix, cache_config={"block_size": "16", "num_gpu_blocks": "2912",
                                                             "cache_dtype": "bf16"})
    assert kv_capacity_tokens(metrics.render().decode()) == 2912 * 16
    assert kv_capacity_tokens("# no such series\n") is None


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--passes", "2"], "--passes needs the HTTP bench"),
    (["--vs", "transformers", "--concurrency", "2"], "--vs transformers runs in process"),
    (["--concurrency", "2", "--request-rate", "3"], "drop --request-rate"),
    (["--vs", "llama-server", "--llama-server", "/no/such/llama-server"], "not found at /no/such/llama-server"),
])
def test_http_flag_mistakes_are_one_line(tmp_path, capsys, argv, message):
    assert main(["bench", "--workload", str(tiny_trace(tmp_path)), *argv, *SMALL_POOL]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.slow
def test_http_cold_and_warm_passes_against_kvserve_serve(tmp_path, capsys):
    assert main(["bench", "--workload", str(tiny_trace(tmp_path)), "--limit", "2", "--max-tokens", "4",
                 "--concurrency", "2", "--passes", "2", "--json", *SMALL_POOL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == REPORT_KEYS | {"http"} and report["http"]["concurrency"] == 2
    assert list(report["engines"]) == ["kvserve/cold", "kvserve/warm"] and report["ratios"] == {}
    cold, warm = report["engines"].values()
    for fig in (cold, warm):
        assert tuple(fig) == ENGINE_KEYS
        assert fig["output_tokens"] == 8 and len(fig["ttft_s"]) == 2 and fig["wall_s"] > 0
        assert 0 < fig["ttft_p50_s"] <= fig["ttft_p95_s"] and fig["peak_rss_bytes"] > 0
    assert warm["cached_prompt_tokens"] == 2 * 47  # every prompt but its last token, from the cold pass
    assert cold["cached_prompt_tokens"] < warm["cached_prompt_tokens"]


@pytest.mark.slow
@pytest.mark.skipif(not llama_server_path().is_file(), reason="llama-server binary absent "
                    "(../shared/peers/llama.cpp/llama-server or $KVSERVE_LLAMA_SERVER)")
def test_http_beside_llama_server(tmp_path, capsys):
    assert main(["bench", "--workload", str(tiny_trace(tmp_path)), "--limit", "2", "--max-tokens", "4",
                 "--vs", "llama-server", "--concurrency", "2", "--json", *SMALL_POOL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["engines"]) == ["kvserve", "llama-server"]
    assert report["http"]["llama_server"]["parallel"] == 2
    peer = report["engines"]["llama-server"]
    assert peer["kv_capacity_tokens"] == report["engines"]["kvserve"]["kv_capacity_tokens"] > 0  # the same KV
    assert peer["output_tokens"] == 8 and len(peer["ttft_s"]) == 2  # ignore_eos: exactly max_tokens
    ratio = report["ratios"]["llama-server"]
    assert set(ratio) == set(RATIO_KEYS) | {"speedup"}
    assert ratio["wall_s"] == pytest.approx(report["engines"]["kvserve"]["wall_s"] / peer["wall_s"])


@pytest.mark.slow
def test_ngram_peer_is_kvserve_again_with_speculation_and_the_same_greedy_tokens(tmp_path, capsys):
    lines = [{"id": "quote", "prompt": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
              "The quick brown fox jumps over the lazy dog. The quick brown", "max_tokens": 24}]
    trace = tmp_path / "quote.jsonl"
    trace.write_text(json.dumps(lines[0]) + "\n")
    assert main(["bench", "--workload", str(trace), "--vs", "ngram", "--json", *SMALL_POOL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["engines"]) == ["kvserve", "kvserve+ngram"]
    assert report["greedy_agreement"]["kvserve+ngram"]["identical_requests"] == 1  # speculation changes no token
    assert report["engines"]["kvserve+ngram"]["output_tokens"] == 24


@pytest.mark.parametrize("user_sets_policy", [False, True])
def test_peers_run_without_the_runtime_settings_kvserve_made(user_sets_policy):
    # kvserve makes OpenMP threads sleep after a short spin; a benchmark peer (llama.cpp) gets its own
    # runtime's defaults, unless the user set the variable, which every engine then sees
    probe = ("import json, os, kvserve; print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), "
             "os.environ.get('GOMP_SPINCOUNT'), kvserve.peer_environment().get('OMP_WAIT_POLICY'), "
             "kvserve.peer_environment().get('GOMP_SPINCOUNT'), os.environ.get('THP_MEM_ALLOC_ENABLE'), "
             "kvserve.peer_environment().get('THP_MEM_ALLOC_ENABLE')]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE", "KVSERVE_RUNTIME_DEFAULTS_SET")}
    if user_sets_policy:
        env["OMP_WAIT_POLICY"] = "ACTIVE"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    ours, spin, peers, peer_spin, huge, peer_huge = json.loads(done.stdout)
    assert peer_spin is None
    assert huge == "1" and peer_huge is None  # torch's huge pages: kvserve's process only
    if user_sets_policy:  # and the short spin, which belongs to the passive policy, is not forced on them
        assert ours == peers == "ACTIVE" and spin is None
    else:
        assert ours == "PASSIVE" and peers is None and spin == "300"
