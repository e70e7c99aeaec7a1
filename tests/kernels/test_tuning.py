"""The kernels' per-host tuning (kernels/tuning.py): every choice the calibration can make gives the same
bits in the matmul's decode rows and tiles and in attention; the choice is forced, skipped, cached and
reported as documented."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import kernels
from kvserve.config import ConfigError
from kvserve.kernels import api, attention as native_attention, matmul as km, tuning
from kvserve.kernels.api import Prefetch

EVERY_CHOICE = [f"{w}/{kv}" for w in tuning.WEIGHT_CANDIDATES for kv in ("l1", "l2", "l3", "none")]


@pytest.fixture
def lib():
    kl = kernels.library()
    if kl is None:
        pytest.skip("native kernels not built")
    yield kl
    tuning.install(kl, tuning.BUILT_IN)


def _blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    fmt = kernels.library().formats[int(qtype)]
    block, size = fmt.block, fmt.bytes
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in {Q.Q6_K: (208,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2)}.get(qtype, (0,)):
        raw[..., off:off + 2] = rng.uniform(0.002, 0.05, size=(n, k // block)).astype(np.float16).view(np.uint8) \
            .reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_every_tuning_choice_gives_the_matmul_the_same_bits(lib, qtype):
    rng = np.random.default_rng(int(qtype))
    k, n = 512, 203  # a tail group past the last full one
    w = _blocks(qtype, n, k, rng)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(1))
    outputs = {}
    for choice in ["l1+0/l1", *EVERY_CHOICE[::4], "l2~64/l1", "l3~1048576/l1"]:
        tuning.install(lib, tuning.parse(choice))
        outputs[choice] = [km.matmul(lib, qtype, w, k, x[:t], num_threads=threads).numpy().tobytes()
                           for t in (1, 3, 8, 16) for threads in (1, 2)]
    first = next(iter(outputs.values()))
    assert all(v == first for v in outputs.values())


BLOCK_FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", BLOCK_FORMATS, ids=lambda q: q.name)
def test_chained_sums_give_the_interleaved_decode_rows_the_same_bits(lib, qtype):
    """The interleaved twin's decode rows with its sums chained by vpdpwssd (where the build can) and widened,
    at 1-16 rows and 1-2 threads: the same bits (the fused linears' parts: the engine's greedy tokens below)."""
    rng = np.random.default_rng(100 + int(qtype))
    k, n = 512, 200
    twin, w = km.interleave(lib, int(qtype), _blocks(qtype, n, k, rng), k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    name = api.Format(int(qtype)).name.lower()
    outputs = {}
    for sums in ("none", name, "q4_0+q4_1+q5_0+q5_1+q8_0+q4_k+q5_k+q6_k"):
        tuning.install(lib, tuning.parse(f"l2~4096/l1/{sums}"))
        chained = tuning.installed(lib).chained_sums
        assert (chained != 0) == (sums != "none" and tuning.can_chain_sums(lib))
        outputs[sums] = [km.matmul(lib, twin, w, k, x[:t], num_threads=threads).numpy().tobytes()
                         for t in (1, 2, 4, 8, 16) for threads in (1, 2)]
    assert outputs["none"] == outputs[name] == outputs["q4_0+q4_1+q5_0+q5_1+q8_0+q4_k+q5_k+q6_k"]


def test_only_a_build_with_vpdpwssd_keeps_the_chained_sums(lib):
    for kl in kernels.simd_libraries():
        tuning.install(kl, tuning.parse("l1+0/l1/q4_k+q8_0"))
        chains = kl.isa in ("avx512", "amx")  # the AMX build is the AVX-512 build with one more prefill tile
        expected = (1 << api.Format.Q4_K | 1 << api.Format.Q8_0) if chains else 0
        assert tuning.installed(kl).chained_sums == expected and tuning.can_chain_sums(kl) == chains
        tuning.install(kl, tuning.BUILT_IN)
        assert tuning.installed(kl).chained_sums == 0


def test_every_kv_prefetch_choice_gives_attention_the_same_bits(lib):
    heads, kv_heads, head_dim, page_size, pages = 6, 2, 64, 16, 40
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(pages, page_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(pages, page_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, heads, head_dim, generator=gen)
    none = torch.empty(1, 0)
    rows = native_attention.AttentionRows(torch.tensor([600, 601, 639]), torch.zeros(3, dtype=torch.int64),
                                          torch.zeros(3, dtype=torch.int64), torch.randperm(pages, generator=gen),
                                          None)
    outputs = set()
    for level in ("l1", "l2", "l3", "none"):
        tuning.install(lib, tuning.parse(f"l1+0/{level}"))
        for threads in (1, 2):
            outputs.add(native_attention.paged_attention(lib, q, "bf16", (k, none), (v, none), page_size, rows, None,
                                                         num_threads=threads).numpy().tobytes())
    assert len(outputs) == 1


def test_a_choice_is_parsed_installed_and_labelled(lib):
    chosen = tuning.parse("l2~8192/l3")
    assert (chosen.weight_prefetch, chosen.weight_ahead, chosen.weight_spread, chosen.kv_prefetch) == \
        (Prefetch.L2, 8192, True, Prefetch.L3)
    tuning.install(lib, chosen)
    installed = tuning.installed(lib)
    assert (installed.weight_prefetch, installed.weight_prefetch_ahead, installed.kv_prefetch,
            installed.weight_prefetch_spread) == (2, 8192, 3, 1)
    assert chosen.label() == "weights prefetch L2 (spread, 8 KiB ahead), KV prefetch L3 [forced]"
    assert tuning.BUILT_IN.as_dict()["weights"] == "l1+0" and tuning.BUILT_IN.as_dict()["sums"] == "none"
    sums = tuning.parse("l2~8192/l3/q6_k+Q4_K")
    assert sums.chained == ("Q4_K", "Q6_K") and sums.sums == "q4_k+q6_k" and sums.as_dict()["sums"] == "q4_k+q6_k"
    assert tuning.parse(f"{sums.weights}/l3/{sums.sums}") == sums and tuning.parse("l2~8192/l3/none") == chosen
    assert sums.label() == "weights prefetch L2 (spread, 8 KiB ahead), KV prefetch L3, sums chained for Q4_K, Q6_K " \
                           "[forced]"
    for bad in ("l4+0/l1", "l1+0/l1/q9_k", "l1+0/l1/f16", "l1+0/l1/q4_k_r8", "l1+0/l1/q4_k/none", "l1+0"):
        with pytest.raises(ConfigError, match="KVSERVE_KERNELS_TUNE must be"):
            tuning.parse(bad)


def test_off_keeps_the_built_in_choice_and_a_forced_one_is_taken_as_given(lib, monkeypatch):
    def never():
        raise AssertionError("no calibration expected")

    monkeypatch.setenv("KVSERVE_KERNELS_TUNE", "off")
    assert tuning.choose(lib, never, never, "shape", 2) == tuning.BUILT_IN
    monkeypatch.setenv("KVSERVE_KERNELS_TUNE", "l3~16384/none")
    assert tuning.choose(lib, never, never, "shape", 2) == tuning.parse("l3~16384/none")


def test_a_calibration_settles_per_host_and_shape_then_is_read_from_the_cache(lib, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("KVSERVE_KERNELS_TUNE", "auto")
    runs = {"decode": 0, "attention": 0}

    def count(name):
        def run():
            runs[name] += 1
        return run

    decode_runs = 1 + tuning.PREFETCH_ROUNDS * len(tuning.WEIGHT_CANDIDATES)  # a warm-up, then the rounds
    for start in range(1, tuning.SETTLE_CALIBRATIONS + 1):
        first = tuning.choose(lib, lambda: count("decode"), lambda: count("attention"), "shape A", 2)
        assert first.source == "calibrated" and runs["decode"] == start * decode_runs
        assert runs["attention"] == start * (1 + tuning.PREFETCH_ROUNDS * len(tuning.KV_CANDIDATES))
    again = tuning.choose(lib, lambda: count("decode"), lambda: count("attention"), "shape A", 2)
    assert again.source == "cached" and tuning.parse(f"{again.weights}/{again.kv_prefetch.name}") == \
        tuning.parse(f"{first.weights}/{first.kv_prefetch.name}")
    assert runs["decode"] == tuning.SETTLE_CALIBRATIONS * decode_runs  # nothing measured once settled
    cached = json.loads((tmp_path / "kernel-tuning.json").read_text())
    (host,) = cached["hosts"]
    row = cached["hosts"][host]["shape A"]
    assert lib.isa in host and "timings_ms" in row and row["calibrations"] == tuning.SETTLE_CALIBRATIONS


def test_the_calibration_chains_the_sums_of_the_formats_it_ran_faster(lib, monkeypatch, tmp_path):
    """Q4_K's rows run faster chained, Q8_0's widened (as on Zen 4): each format gets its own choice, cached;
    a build that cannot chain is never asked for the passes."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("KVSERVE_KERNELS_TUNE", "auto")
    asked = []

    def passes():
        asked.append(1)

        def rows_of(name: str, chained_ms: float, widened_ms: float):
            def run():
                chained = tuning.installed(lib).chained_sums >> api.Format[name] & 1
                time.sleep((chained_ms if chained else widened_ms) / 1e3)
            return run
        return {"Q4_K": rows_of("Q4_K", 1.0, 3.0), "Q8_0": rows_of("Q8_0", 3.0, 1.0)}
    for _ in range(tuning.SETTLE_CALIBRATIONS):
        chosen = tuning.choose(lib, lambda: (lambda: None), lambda: (lambda: None), "shape S", 2, passes)
    can = tuning.can_chain_sums(lib)
    assert chosen.chained == (("Q4_K",) if can else ()) and len(asked) == (tuning.SETTLE_CALIBRATIONS if can else 0)
    cached = tuning.choose(lib, lambda: (lambda: None), lambda: (lambda: None), "shape S", 2, passes)
    assert (cached.source, cached.chained) == ("cached", chosen.chained)
    (row,) = json.loads((tmp_path / "kernel-tuning.json").read_text())["hosts"].values()
    assert row["shape S"]["sums"] == ("q4_k" if can else "none")
    if can:
        ms = row["shape S"]["timings_ms"]
        assert ms["sums Q4_K chained"] < ms["sums Q4_K widened"] and ms["sums Q8_0 chained"] > ms["sums Q8_0 widened"]


def test_a_start_disturbed_by_load_is_outvoted_by_each_candidates_best_time(lib, monkeypatch, tmp_path):
    """l2~8192 lost the first start's pass to another process (9 ms against l1+0's 4); the next start runs it
    in 3 ms: from then on it is chosen, and the cache keeps each candidate's best of both starts."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("KVSERVE_KERNELS_TUNE", "auto")
    starts = [{"l2~8192": 9.0, "l1+0": 4.0}, {"l2~8192": 3.0, "l1+0": 5.0}, {"l2~8192": 6.0, "l1+0": 4.5}]
    kv_ms = {"L1": 2.0, "L2": 1.0}
    calls = []

    def fake_time_each(candidates, kl, run, rounds=tuning.PREFETCH_ROUNDS):
        calls.append(1)
        table = kv_ms if set(candidates) & set(kv_ms) else starts[(len(calls) - 1) // 2]
        return {name: table.get(name, 10.0) / 1e3 for name in candidates}
    monkeypatch.setattr(tuning, "_time_each", fake_time_each)
    chosen = [tuning.choose(lib, lambda: None, lambda: None, "shape E", 2) for _ in starts]
    assert [c.weights for c in chosen] == ["l1+0", "l2~8192", "l2~8192"]
    assert all(c.kv_prefetch == Prefetch.L2 for c in chosen)
    settled = tuning.choose(lib, lambda: None, lambda: None, "shape E", 2)
    assert (settled.weights, settled.source, len(calls)) == ("l2~8192", "cached", 6)
    (row,) = json.loads((tmp_path / "kernel-tuning.json").read_text())["hosts"].values()
    best_ms = row["shape E"]["timings_ms"]
    assert (best_ms["weights l2~8192"], best_ms["weights l1+0"], row["shape E"]["calibrations"]) == (3.0, 4.0, 3)


def test_the_engine_installs_its_choice_and_greedy_tokens_do_not_depend_on_it(lib, monkeypatch):
    from tests.conftest import make_llm
    from kvserve import SamplingParams

    tokens = set()
    for choice in ("l1+0/l1", "none+0/none", "l2~16384/l3", "l2~8192/l2/q4_0+q4_1+q5_0+q5_1+q8_0+q4_k+q5_k+q6_k"):
        monkeypatch.setenv("KVSERVE_KERNELS_TUNE", choice)
        llm = make_llm(dtype="native")
        assert llm.engine.runner.kernel_tuning == tuning.parse(choice)
        assert tuning.installed(lib).weight_prefetch == int(tuning.parse(choice).weight_prefetch)
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0.0))
        tokens.add(tuple(out[0].outputs[0].token_ids))
    assert len(tokens) == 1


both_simd = pytest.mark.skipif(not {"avx2", "avx512"} <= set(kernels.host_isas()),
                               reason="needs a host that runs both AVX2 and AVX-512")


@pytest.fixture
def isa_unchosen(monkeypatch, tmp_path):
    """A fresh tuning cache and no instruction set chosen, before and after (the choice is per process)."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("KVSERVE_KERNELS_TUNE", "auto")
    monkeypatch.delenv("KVSERVE_KERNELS_ISA", raising=False)
    kernels.use_isa(None)
    yield tmp_path
    kernels.use_isa(None)


def _slower_unless(winner: str):
    """make_decode_pass for choose_isa: every build but `winner` takes 3 ms longer."""
    def make(kl):
        def run():
            if kl.isa != winner:
                import time
                time.sleep(0.003)
        return run
    return make


@both_simd
@pytest.mark.parametrize("winner", ["avx2", "avx512"])
def test_the_faster_instruction_set_is_chosen_cached_and_used_by_the_process(lib, isa_unchosen, winner):
    for _ in range(tuning.SETTLE_CALIBRATIONS):
        chosen, rows, source = tuning.choose_isa(lib, tuning.BUILT_IN, _slower_unless(winner),
                                                 _slower_unless(winner), "shape B", 2)
        assert (chosen.isa, rows.isa, source) == (winner, winner, "calibrated")
        assert kernels.library().isa == kernels.library(1).isa == kernels.library(500).isa == winner  # later callers
        kernels.use_isa(None)
    again, rows, source = tuning.choose_isa(lib, tuning.BUILT_IN, _slower_unless("neither"),
                                            _slower_unless("neither"), "shape B", 2)
    assert (again.isa, rows.isa, source) == (winner, winner, "cached")  # nothing timed: the pass would pick avx2
    cached = json.loads((isa_unchosen / "kernel-tuning.json").read_text())
    assert any(" any 2 threads " in host and cached["hosts"][host]["shape B"]["isa"] == winner
               for host in cached["hosts"])


def _pass_taking(ms: dict[str, float]):
    """make_*_pass for choose_isa: each build's pass takes its time in ms (a build not named, as AMX on a host
    that has it, 10 ms: the slowest)."""
    def make(kl):
        def run():
            import time
            time.sleep(ms.get(kl.isa, 10.0) / 1000)
        return run
    return make


@both_simd
def test_the_decode_rows_and_the_prefill_tiles_each_get_their_faster_build(lib, isa_unchosen):
    """AVX2 ahead on the one-row pass, AVX-512 on the prefill chunk (Zen 4's calibration: 6.54 against 6.98 ms,
    5.12 against 4.32 ms): calls of up to DECODE_ROWS rows run on AVX2, longer ones on AVX-512."""
    decode, prefill = _pass_taking({"avx2": 3.0, "avx512": 3.6}), _pass_taking({"avx2": 6.0, "avx512": 3.0})
    chosen, rows, source = tuning.choose_isa(lib, tuning.BUILT_IN, decode, prefill, "shape D", 2)
    assert (chosen.isa, rows.isa, source) == ("avx512", "avx2", "calibrated")
    assert kernels.library(api.DECODE_ROWS).isa == "avx2" and kernels.library(api.DECODE_ROWS + 1).isa == "avx512"
    assert kernels.library().isa == "avx512"


@both_simd
@pytest.mark.parametrize("avx2_ms, chosen", [(3.5, "widest"), (3.1, "avx2")])
def test_the_narrower_build_replaces_the_widest_only_by_the_margin(lib, isa_unchosen, avx2_ms, chosen):
    """AVX2 ahead of the widest build (AVX-512, or AMX where the host has it) by 3% (within ISA_MARGIN: a
    disturbed calibration, cached, would keep a slower build for every later start) leaves the widest; ahead by
    14%, it is chosen. Whatever the current library."""
    widest = kernels.simd_isas()[-1]
    passes = _pass_taking({"avx2": avx2_ms, widest: 3.6})
    got, rows, source = tuning.choose_isa(lib, tuning.BUILT_IN, passes, passes, f"shape {avx2_ms}", 2)
    chosen = widest if chosen == "widest" else chosen
    assert (got.isa, rows.isa, source) == (chosen, chosen, "calibrated")


@both_simd
def test_an_instruction_set_chosen_under_load_is_taken_back_at_the_next_starts(lib, isa_unchosen):
    """The first start's AVX-512 passes ran beside another process (AVX2 ahead by past the margin); the next
    starts run them at their own speed, and each build's best time over the starts puts AVX-512 back."""
    for avx512_ms, chosen in ((6.0, "avx2"), (3.0, "avx512"), (5.0, "avx512")):
        passes = _pass_taking({"avx2": 4.0, "avx512": avx512_ms})
        got, rows, source = tuning.choose_isa(lib, tuning.BUILT_IN, passes, passes, "shape F", 2)
        assert (got.isa, rows.isa, source) == (chosen, chosen, "calibrated")
        kernels.use_isa(None)
    assert tuning.choose_isa(lib, tuning.BUILT_IN, passes, passes, "shape F", 2)[2] == "cached"


@both_simd
def test_a_forced_instruction_set_or_tuning_skips_the_choice(lib, isa_unchosen, monkeypatch):
    def never(kl):
        raise AssertionError("nothing is timed when the choice is forced")
    monkeypatch.setenv("KVSERVE_KERNELS_ISA", "avx2")
    assert tuning.choose_isa(lib, tuning.BUILT_IN, never, never, "shape C", 2)[2] == "forced"
    monkeypatch.delenv("KVSERVE_KERNELS_ISA")
    for spec in ("off", "l2~8192/l3"):
        monkeypatch.setenv("KVSERVE_KERNELS_TUNE", spec)
        assert tuning.choose_isa(lib, tuning.BUILT_IN, never, never, "shape C", 2) == (lib, lib, "built-in")


@both_simd
def test_the_engine_runs_on_the_chosen_instruction_set_with_the_same_greedy_tokens(lib, isa_unchosen, monkeypatch):
    """Each build made to win the engine's calibration in turn, and each winning one kind of call only: the
    model's linears, kernels.library() and the start-up label follow the choice, and greedy tokens and
    their logprobs are the same whichever build runs the decode rows and the prefill tiles."""
    from kvserve import SamplingParams
    from kvserve.model import runner
    from tests.conftest import make_llm

    answers = {}
    for prefill_winner, decode_winner in (("avx2", "avx2"), ("avx512", "avx512"), ("avx512", "avx2"),
                                          ("avx2", "avx512")):
        kernels.use_isa(None)
        monkeypatch.setenv("KVSERVE_CACHE", str(isa_unchosen / f"{prefill_winner}-{decode_winner}"))
        isa_passes = []  # choose_isa times the decode pass, then the prefill pass

        def fake_time_runs(runs, *a, p=prefill_winner, d=decode_winner, **k):
            if not {"avx2", "avx512"} <= set(runs):
                return {name: 1.0 for name in runs}  # the prefetch candidates
            isa_passes.append(1)
            winner = d if len(isa_passes) == 1 else p
            return {name: 1.0 if name == winner else 2.0 for name in runs}
        monkeypatch.setattr(tuning, "_time_runs", fake_time_runs)
        runner.build_model.cache_clear()
        llm = make_llm(dtype="native")
        chosen = llm.engine.runner.kernel_tuning
        assert (chosen.isa, chosen.decode_isa) == (prefill_winner, decode_winner)
        assert "[calibrated]" in chosen.label() and (f"decode rows {decode_winner}" in chosen.label()) == (
            prefill_winner != decode_winner)
        assert kernels.library().isa == prefill_winner and kernels.library(1).isa == decode_winner
        linears = [m for m in llm.engine.runner.model.modules() if hasattr(m, "row_library")]
        assert linears and all((m.library.isa, m.row_library.isa) == (prefill_winner, decode_winner) for m in linears)
        out = llm.generate(["The capital of France is", "1, 1, 2, 3, 5,"],
                           SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2))
        answers[prefill_winner, decode_winner] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]
    runner.build_model.cache_clear()
    assert len({repr(a) for a in answers.values()}) == 1


def test_the_decode_pass_reads_the_layers_and_the_vocabulary_in_a_steps_shares():
    """A step reads every layer's matrices and the vocabulary's; the pass reads both in those shares. The
    vocabulary's matrix comes first in module order (the tied embedding), and a pass of the first matrices
    up to its size had timed it alone: Gemma-3-270m's and Qwen2.5-1.5B's calibration never saw a layer."""
    from kvserve.model.kernel_tuning import decode_calls
    from kvserve.model.linear import NativeLinear

    def linear(qtype: Q, rows: int, row_bytes: int) -> NativeLinear:
        return NativeLinear([(int(qtype), torch.zeros(rows, row_bytes, dtype=torch.uint8))], 256, None, None)

    layers = [linear(Q.Q4_K, 256, 144) for _ in range(40)]  # 36,864 bytes each, 1,474,560 in all
    head = linear(Q.Q6_K, 4096, 210)  # 860,160 bytes: 36.8% of the step
    calls = decode_calls(layers, head, up_to=400_000)
    *from_layers, (qtype, head_rows, k) = calls
    assert [blocks.data_ptr() for _, blocks, _ in from_layers] == [m.blocks(0).data_ptr() for m in layers[:7]]
    assert (qtype, k, head_rows.data_ptr()) == (int(Q.Q6_K), 256, head.blocks(0).data_ptr())
    layer_bytes, head_bytes = sum(b.numel() for _, b, _ in from_layers), head_rows.numel()
    assert 400_000 * 0.632 <= layer_bytes < 400_000 * 0.632 + 36_864  # whole matrices, in order
    assert head_bytes == 400_000 * 860_160 // 2_334_720 // 210 // 8 * 8 * 210  # the head's first rows, whole groups
    # a vocabulary's matrix a hundred times the layers': they still get their share, a matrix at least
    big = decode_calls(layers[:4], linear(Q.Q6_K, 65536, 210), up_to=400_000)
    assert [b.shape[0] for _, b, _ in big] == [256, (400_000 * 13_762_560 // 13_910_016) // 210 // 8 * 8]
    assert decode_calls(layers, None, up_to=400_000)[-1][1] is layers[10].blocks(0)  # no head: layers only
