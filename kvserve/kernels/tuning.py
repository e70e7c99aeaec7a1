"""The kernels' per-host tuning: the instruction set where the CPU runs two SIMD builds (AVX2 and AVX-512:
on Zen 4's 256-bit units the wider build is not always the faster), where and how far ahead the decode rows
prefetch the weights, where attention prefetches the KV rows, and which formats' decode rows add their integer
sums through VNNI's vpdpwssd on the AVX-512 build (src/kvs_api.h KvsTuning). No choice
changes a bit of any result, only speed, and the right one differs by CPU (Zen 5 wants L1, Zen 4 L2), so
it is measured on the host: a calibration of a few hundred ms on the model's own weights, cached per CPU
model in ~/.cache/kvserve. A choice settles after SETTLE_CALIBRATIONS starts, each candidate keeping its
best time of them all, so that one start disturbed by another process's load is not cached for every
later one. The instruction set is calibrated only under `auto`; KVSERVE_KERNELS_ISA forces one.

`KVSERVE_KERNELS_TUNE`: unset or `auto` calibrates (or reads the cache), `off` keeps the built-in defaults,
`WEIGHTS/KV[/SUMS]` forces one choice: WEIGHTS a level, then `+BYTES` ahead in one burst a group or `~BYTES`
spread over its blocks, e.g. `l2~8192/l3` (levels: none, l1, l2, l3); SUMS the formats whose sums chain, joined
by `+` (`q4_k+q6_k`), or `none` (the built-in)."""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve import kernels
from kvserve.kernels import KernelLibrary, cpu_flags, cpu_info
from kvserve.kernels.api import Format, KvsTuning, Prefetch

# 2: prefetches really issued (GCC had deleted them all in 1); 3: timed on the thread team; 4: the distance
# counted past the group's end, and the instruction set chosen; 5: chosen on prefill too; 6: chosen for the
# decode rows and for the prefill tiles apart; 7: the decode pass reads the layers and the vocabulary's matrix
# in a step's shares (it had timed the vocabulary's matrix alone where that came first and filled the pass);
# 8: a narrower build is chosen only by ISA_MARGIN (choices cached before could hold a disturbed calibration's);
# 9: a choice settles after SETTLE_CALIBRATIONS, merged by each candidate's best time; 10: the chained sums;
# 11: an interleaved group's spread prefetch counted from the step being computed, and nearer candidates
CACHE_VERSION = 11


@dataclass(frozen=True, slots=True)
class Tuning:
    weight_prefetch: Prefetch
    weight_ahead: int  # bytes ahead of the group being computed; 0: two groups of eight rows
    kv_prefetch: Prefetch
    weight_spread: bool = False  # the group's prefetch spread over its blocks (else one burst)
    source: str = "built-in"  # built-in, calibrated, cached or forced
    isa: str = field(default="", compare=False)  # the instruction set of calls of more than DECODE_ROWS rows
    isa_source: str = field(default="", compare=False)  # built-in, calibrated, cached or forced
    decode_isa: str = field(default="", compare=False)  # that of the decode rows (up to DECODE_ROWS), if another
    chained: tuple[str, ...] = ()  # the formats whose decode rows add their sums by vpdpwssd (Format names, sorted)

    @property
    def weights(self) -> str:
        """The weights' part as KVSERVE_KERNELS_TUNE spells it: `l2~8192`."""
        return f"{self.weight_prefetch.name.lower()}{'~' if self.weight_spread else '+'}{self.weight_ahead}"

    @property
    def sums(self) -> str:
        """The chained sums' part as KVSERVE_KERNELS_TUNE spells it: `q4_k+q6_k` or `none`."""
        return "+".join(name.lower() for name in self.chained) or "none"

    def label(self) -> str:
        ahead = f"{self.weight_ahead // 1024} KiB ahead" if self.weight_ahead else "two groups ahead"
        how = f"{'spread' if self.weight_spread else 'burst'}, {ahead}" if self.weight_prefetch else ""
        rows = f", decode rows {self.decode_isa}" if self.decode_isa and self.decode_isa != self.isa else ""
        isa = f"{self.isa}{rows} [{self.isa_source}], " if self.isa else ""
        sums = f", sums chained for {', '.join(self.chained)}" if self.chained else ""
        return (f"{isa}weights prefetch {self.weight_prefetch.name}{f' ({how})' if how else ''}, "
                f"KV prefetch {self.kv_prefetch.name}{sums} [{self.source}]")

    def as_dict(self) -> dict:
        return {"weights": self.weights, "kv": self.kv_prefetch.name.lower(), "sums": self.sums, "source": self.source,
                "isa": self.isa, "decode_isa": self.decode_isa or self.isa, "isa_source": self.isa_source,
                "label": self.label()}


BUILT_IN = Tuning(Prefetch.L1, 0, Prefetch.L1)
ISA_ROUNDS = 7  # the builds are often within a few percent: more rounds than the prefetch choices get
# another build replaces the built-in one (the widest this CPU runs) only when it ran its pass this much faster:
# the builds' real gap is a few percent where the other wins (Zen 4's AVX2 decode rows), while a choice made
# under another process's load and then cached once put Gemma's prefill on AVX2's tiles (no VNNI) at 1.5x the
# time for every later start (the cache kept 5.83 against 6.35 ms, AVX-512 being 3.4 ms on a quiet host)
ISA_MARGIN = 0.10
PREFETCH_ROUNDS = 5
SUMS_ROUNDS = 7  # chaining moves Zen 4's hot rows by 1-6% either way: more rounds than the prefetch choices get
# starts that calibrate before a host and shape's choice is read from the cache alone: each adds its rounds to
# the cached ones (a candidate keeps its best time), so a choice rests on passes minutes or days apart, not
# on the seconds of one start that another process's load can fill (a few hundred ms each, the first starts
# only)
SETTLE_CALIBRATIONS = 3
# what the calibration tries for the weights (KVSERVE_KERNELS_TUNE's spelling) and for the KV rows
WEIGHT_CANDIDATES = ["l1+0", "l1~1024", "l1~4096", "l1~8192", "l2~2048", "l2~4096", "l2~8192", "l2~16384",
                     "l2~32768", "l3~16384", "none+0"]
KV_CANDIDATES = [Prefetch.L1, Prefetch.L2, Prefetch.L3, Prefetch.NONE]


def install(kl: KernelLibrary, tuning: Tuning) -> None:
    chained = sum(1 << Format[name] for name in tuning.chained)
    kl.lib.kvs_set_tuning(ctypes.byref(KvsTuning(int(tuning.weight_prefetch), tuning.weight_ahead,
                                                 int(tuning.kv_prefetch), int(tuning.weight_spread), chained)))


def can_chain_sums(kl: KernelLibrary) -> bool:
    """Whether kl's decode rows can add their sums by vpdpwssd (the build keeps the bits only where it can)."""
    before = installed(kl)
    probe = KvsTuning(before.weight_prefetch, before.weight_prefetch_ahead, before.kv_prefetch,
                      before.weight_prefetch_spread, 1 << Format.Q4_K)
    kl.lib.kvs_set_tuning(ctypes.byref(probe))
    can = installed(kl).chained_sums != 0
    kl.lib.kvs_set_tuning(ctypes.byref(before))
    return can


def installed(kl: KernelLibrary) -> KvsTuning:
    out = KvsTuning()
    kl.lib.kvs_get_tuning(ctypes.byref(out))
    return out


def parse_weights(spec: str) -> tuple[Prefetch, int, bool]:
    """`l2~8192` -> (level, bytes ahead, spread)."""
    spread = "~" in spec
    level, _, ahead = spec.replace("~", "+").partition("+")
    return Prefetch[level.upper()], int(ahead or 0), spread


def parse_sums(spec: str) -> tuple[str, ...]:
    """`q4_k+q6_k` -> ("Q4_K", "Q6_K"); `none` -> ()."""
    if spec in ("", "none"):
        return ()
    names = sorted({Format[name.upper()].name for name in spec.split("+")})
    if any(f"{name}_R8" not in Format.__members__ for name in names):  # only a format with an interleaved twin
        raise KeyError(spec)
    return tuple(names)


def parse(spec: str, source: str = "forced") -> Tuning:
    """`WEIGHTS/KV[/SUMS]`, e.g. `l2~8192/l3` or `l2~8192/l3/q4_k+q6_k`."""
    try:
        weights, kv, *sums = spec.lower().split("/")
        if len(sums) > 1:
            raise ValueError(spec)
        level, ahead, spread = parse_weights(weights)
        return Tuning(level, ahead, Prefetch[kv.upper()], spread, source, chained=parse_sums(sums[0] if sums else ""))
    except (ValueError, KeyError):
        raise ConfigError(f"KVSERVE_KERNELS_TUNE must be auto, off or WEIGHTS/KV[/SUMS]: a level (none, l1, l2, "
                          f"l3), +BYTES (a burst) or ~BYTES (spread) ahead, then the KV's level, then the block "
                          f"formats whose sums chain joined by + (or none), e.g. l2~8192/l3/q4_k+q6_k; "
                          f"got {spec!r}") from None


def host_key(isa: str, threads: int) -> str:
    """The CPU model, instruction set (`any`: the choice of one), thread count and kernel sources a cached
    choice was measured with (kernels that changed may rank the candidates otherwise)."""
    cpu = cpu_info()
    return (f"{cpu.get('model name', '?')} family {cpu.get('cpu family', '?')} model {cpu.get('model', '?')} "
            f"{isa} {threads} threads {len(cpu_flags())} flags kernels {kernels.source_digest()}")


def cache_path() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve")) / "kernel-tuning.json"


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
        return data if data.get("version") == CACHE_VERSION else {"version": CACHE_VERSION}
    except (OSError, ValueError):
        return {"version": CACHE_VERSION}


def _write_cache(key: str, shape_key: str, row: dict, timings: dict, calibrations: int) -> None:
    data = _read_cache()
    data.setdefault("hosts", {}).setdefault(key, {})[shape_key] = {**row, "timings_ms": timings,
                                                                   "calibrations": calibrations}
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: calibrate again next time


def _cached_row(key: str, shape_key: str) -> dict | None:
    row = _read_cache().get("hosts", {}).get(key, {}).get(shape_key)
    return row if isinstance(row, dict) else None


def _settled(row: dict | None) -> bool:
    return row is not None and int(row.get("calibrations", 0)) >= SETTLE_CALIBRATIONS


def _merged(row: dict | None, timings_ms: dict[str, float]) -> tuple[dict[str, float], int]:
    """(each candidate's best time over this calibration and the cached ones, how many calibrations that is).
    Another process's load only ever adds time, so the best of passes taken at several starts is the
    candidate's own speed."""
    if row is None or not isinstance(row.get("timings_ms"), dict):
        return timings_ms, 1
    merged = {name: min(ms, float(row["timings_ms"].get(name, ms))) for name, ms in timings_ms.items()}
    return merged, int(row.get("calibrations", 1)) + 1


def _cached(row: dict | None) -> Tuning | None:
    try:
        return parse(f"{row['weights']}/{row['kv']}/{row['sums']}", "cached") if _settled(row) else None
    except (KeyError, TypeError, ConfigError):
        return None


AUTO = ("", "auto", "on")  # KVSERVE_KERNELS_TUNE's spellings of a calibration


def _tune_spec() -> str:
    return os.environ.get("KVSERVE_KERNELS_TUNE", "auto").strip().lower()


def _best(timings: dict[str, float]) -> str:
    return min(timings, key=timings.get)


def _beats_built_in(timings: dict[str, float], built_in: str) -> str:
    """The build that ran its pass fastest if it beat the built-in one by ISA_MARGIN, else the built-in."""
    best = _best(timings)
    return best if timings[best] < (1 - ISA_MARGIN) * timings[built_in] else built_in


def _chained(timings_ms: dict[str, float]) -> list[str]:
    """The formats whose decode rows ran faster chained (`sums Q4_K chained` against `sums Q4_K widened`)."""
    formats = {name.split(" ")[1] for name in timings_ms if name.startswith("sums ")}
    return sorted(f for f in formats if timings_ms[f"sums {f} chained"] < timings_ms[f"sums {f} widened"])


def choose(kl: KernelLibrary, make_decode_pass, make_attention_pass, shape_key: str, threads: int,
           make_sums_passes=dict) -> Tuning:
    """The tuning for this process: forced, built-in, cached, or measured now. `make_decode_pass()` gives a
    function that runs the model's decode-step matmuls once (one activation row), `make_attention_pass()`
    one that runs a decode row's attention over a long context, `make_sums_passes()` {format name: a function
    that runs decode rows of that format from the cache} for the interleaved formats the model's decode rows
    read (asked only where kl can chain sums: the choice is about compute, so it is timed where the weights do
    not stream); all only to be timed, and made only when a calibration runs."""
    spec = _tune_spec()
    if spec in ("off", "0", "no", "false"):
        return BUILT_IN
    if spec not in AUTO:
        return parse(spec)
    key = host_key(kl.isa, threads)
    row = _cached_row(key, shape_key)
    cached = _cached(row)
    if cached is not None:
        return cached
    built_in_kv = BUILT_IN.kv_prefetch.name
    weights = _time_each({w: parse(f"{w}/{built_in_kv}") for w in WEIGHT_CANDIDATES}, kl, make_decode_pass())
    kv = _time_each({p.name: parse(f"{_best(weights)}/{p.name}") for p in KV_CANDIDATES}, kl,
                    make_attention_pass())  # (the attention pass reads no weights: any weights' choice will do)
    prefetch = f"{_best(weights)}/{_best(kv)}"
    sums = {f"{name} {how}": ms for name, run in (make_sums_passes() if can_chain_sums(kl) else {}).items()
            for how, ms in _time_each({"chained": parse(f"{prefetch}/{name}"), "widened": parse(prefetch)}, kl, run,
                                      SUMS_ROUNDS).items()}
    timings, calibrations = _merged(row, {**{f"weights {k}": round(v * 1e3, 3) for k, v in weights.items()},
                                          **{f"kv {k}": round(v * 1e3, 3) for k, v in kv.items()},
                                          **{f"sums {k}": round(v * 1e3, 4) for k, v in sums.items()}})
    best = {part: _best({name.split(" ", 1)[1]: ms for name, ms in timings.items() if name.startswith(part)})
            for part in ("weights", "kv")}
    tuning = parse(f"{best['weights']}/{best['kv']}/{'+'.join(_chained(timings))}", "calibrated")
    _write_cache(key, shape_key, tuning.as_dict(), timings, calibrations)
    return tuning


def choose_isa(current: KernelLibrary, prefetch: Tuning, make_decode_pass, make_prefill_pass, shape_key: str,
               threads: int) -> tuple[KernelLibrary, KernelLibrary, str]:
    """This process's instruction sets (that of calls of more than DECODE_ROWS rows, that of the decode
    rows) and where the choice came from. Forced by KVSERVE_KERNELS_ISA; the built-in (`current`, the best this CPU
    runs) unless the tuning is auto and the CPU runs two SIMD builds; else cached, or measured now:
    `make_decode_pass(kl)` and `make_prefill_pass(kl)` give functions that run the model's matmuls for one
    row and for a prefill chunk on library kl, each timed on each build alternated under the same
    prefetch choice. Each kind of call gets the build that ran its pass faster by ISA_MARGIN, else the
    widest (on Zen 4, AVX-512's VNNI tiles; at times AVX2's decode rows): the builds give the same bits, so
    a step may run on either. They become what `kernels.library(rows)` gives from then on."""
    if kernels.forced_isa():
        return current, current, "forced"
    candidates = {kl.isa: kl for kl in kernels.simd_libraries()}
    if _tune_spec() not in AUTO or len(candidates) < 2:
        return current, current, "built-in"
    key = host_key("any", threads)
    row = _cached_row(key, shape_key)
    if _settled(row) and row.get("isa") in candidates and row.get("decode_isa") in candidates:
        chosen, decode_chosen, source = candidates[row["isa"]], candidates[row["decode_isa"]], "cached"
    else:
        for kl in candidates.values():
            install(kl, prefetch)
        # each build's best round: the builds differ by 5-20% and another process's load only ever adds
        # time (medians of 7 taken beside another session's tests once put AVX2's decode at 15.9 ms against
        # AVX-512's 8.2, and its prefill the other way round)
        decode, prefill = (_time_runs({isa: make(kl) for isa, kl in candidates.items()}, ISA_ROUNDS, best=True)
                           for make in (make_decode_pass, make_prefill_pass))
        timings, calibrations = _merged(row, {f"{part} {isa}": round(t * 1e3, 3) for part, times in
                                              (("decode", decode), ("prefill", prefill)) for isa, t in times.items()})
        widest = list(candidates)[-1]  # the built-in: kernels.host_isas lists the slowest first
        chosen, decode_chosen = (candidates[_beats_built_in({isa: timings[f"{part} {isa}"] for isa in candidates},
                                                            widest)] for part in ("prefill", "decode"))
        source = "calibrated"
        _write_cache(key, shape_key, {"isa": chosen.isa, "decode_isa": decode_chosen.isa}, timings, calibrations)
    kernels.use_isa(chosen.isa, decode_chosen.isa)
    return chosen, decode_chosen, source


def _time_each(candidates: dict[str, Tuning], kl: KernelLibrary, run,
               rounds: int = PREFETCH_ROUNDS) -> dict[str, float]:
    """Each candidate's best time of `run`, installed in kl (see _time_runs: another process's load only
    adds time, so the fastest round is the candidate's own speed)."""
    def installed_then(tuning: Tuning):
        def timed() -> None:
            install(kl, tuning)
            run()
        return timed
    run()
    return _time_runs({name: installed_then(tuning) for name, tuning in candidates.items()}, rounds, warm=False,
                      best=True)


def _time_runs(runs: dict[str, object], rounds: int = 3, warm: bool = True, best: bool = False) -> dict[str, float]:
    """Each run's median time (`best`: its fastest), the runs alternated round by round after one warm-up
    each (the host takes time away unannounced: alternation spreads it, the median resists it)."""
    if warm:
        for run in runs.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: (min if best else statistics.median)(values) for name, values in samples.items()}
