"""Micro-benchmark of a model's matmuls by weight mode: the GEMVs of one decode step (every layer's
QKV, O, gate+up and down, then the lm_head) and one prefill chunk, with the bandwidth against the
bytes the weights occupy. `python -m kvserve.tools.matmul_bench [--model M] [--modes native,int4]`;
`--formats Q4_K,Q6_K` also times the native kernels on the model's layer shapes with random weights
in each of those GGUF formats."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn

from kvserve.config import ConfigError
from kvserve.kernels.api import FormatInfo


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]


def _bytes(module: nn.Module) -> int:
    """Bytes a pass reads: the module's tensors except Int4Linear's unpacked-copy buffers."""
    skip = {"nibbles", "scale_g", "zero_g"}
    return sum(b.numel() * b.element_size() for n, b in module.named_buffers() if n not in skip) + \
        sum(p.numel() * p.element_size() for p in module.parameters())


def _time(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds per thread): on a shared host the CPU time
    is what one unloaded core would take, the wall time what this run got."""
    fn()  # warm
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append((time.process_time() - start_cpu) / torch.get_num_threads())
    return statistics.median(wall), statistics.median(cpu)


def bench(model_name: str | None, modes: list[str], prefill_rows: int, repeats: int) -> list[str]:
    from kvserve.model.gguf_loader import load_gguf, resolve_model_path
    from kvserve.model.llama import LlamaModel

    loaded = load_gguf(resolve_model_path(model_name))
    lines = [f"model {loaded.path}, {torch.get_num_threads()} threads"]
    for mode in modes:
        model = LlamaModel(loaded.config, loaded.tensors, mode)
        layers = _layers(model)
        head = model.lm_head
        step_bytes = sum(map(_bytes, layers)) + _bytes(head)
        xs = {m: torch.randn(1, _in_features(m)).to(model.dtype) for m in [*layers, head]}
        chunk = {m: torch.randn(prefill_rows, _in_features(m)).to(model.dtype) for m in layers}

        @torch.inference_mode()
        def step() -> None:
            for m in layers:
                m(xs[m])
            head(xs[head])

        @torch.inference_mode()
        def prefill() -> None:
            for m in layers:
                m(chunk[m])

        (w_step, c_step), (w_pre, c_pre) = _time(step, repeats), _time(prefill, max(1, repeats // 10))
        lines.append(f"{mode:>8}: decode step ({len(layers)} GEMVs + lm_head, {step_bytes / 1e6:.1f} MB) "
                     f"wall {w_step * 1e3:.2f} ms = {step_bytes / w_step / 1e9:.1f} GB/s, "
                     f"cpu {c_step * 1e3:.2f} ms = {step_bytes / c_step / 1e9:.1f} GB/s; "
                     f"{prefill_rows}-row prefill chunk (layers) wall {w_pre * 1e3:.0f} ms, cpu {c_pre * 1e3:.0f} ms")
    return lines


def _random_blocks(fmt: FormatInfo, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """[n, row bytes] uint8 of format `fmt`: random codes, every fp16 scale a small positive number."""
    qtype = int(fmt.format)
    if fmt.is_float:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w = w if qtype == 0 else w.astype(np.float16)  # BF16 times as F16: same bytes, same work
        return torch.from_numpy(w.view(np.uint8).reshape(n, -1))
    block, size = fmt.block, fmt.bytes
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scale_offsets = {14: (208,), 3: (0, 2), 7: (0, 2), 12: (0, 2), 13: (0, 2)}.get(qtype, (0,))
    for off in scale_offsets:
        scales = rng.uniform(0.002, 0.05, size=(n, k // block)).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def bench_formats(model_name: str | None, formats: list[str], prefill_rows: int, repeats: int) -> list[str]:
    """The native kernels on the model's layer shapes (QKV, O, gate+up, down of every layer) with
    random weights in each format: one decode step's GEMVs and one prefill chunk (single-threaded
    comparisons are the steadiest on a shared host: `--threads 1`)."""
    from gguf import GGMLQuantizationType

    from kvserve import kernels
    from kvserve.kernels import matmul as km
    from kvserve.model.gguf_loader import load_gguf, resolve_model_path

    kl = kernels.library()
    if kl is None:
        raise ConfigError("--formats needs the native kernels")
    loaded = load_gguf(resolve_model_path(model_name))
    c = loaded.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size)]
    rng = np.random.default_rng(0)
    lines = [f"native kernels ({kl.isa}) on {c.num_layers} x {shapes} (N, K), random weights"]
    for name in formats:
        try:
            qtype = int(GGMLQuantizationType[name.upper()])
        except KeyError:
            raise ConfigError(f"unknown GGUF format {name!r}") from None
        if not km.supported(kl, qtype):
            raise ConfigError(f"the native kernels do not run {name}")
        fmt = kl.formats[qtype]
        block = fmt.block  # K-quants: each K rounded up to whole superblocks of 256
        sized = [(n, -(-k // block) * block) for n, k in shapes]
        calls = [(km.PreparedMatmul(kl, qtype, _random_blocks(fmt, n, k, rng), k), n, k) for n, k in sized]
        threads = torch.get_num_threads()
        one = [(f, torch.randn(1, k), torch.empty(1, n)) for f, n, k in calls]
        many = [(f, torch.randn(prefill_rows, k), torch.empty(prefill_rows, n)) for f, n, k in calls]

        def run(args: list) -> None:
            for f, x, y in args:
                f(x, y, threads)

        layers = c.num_layers
        step_bytes = layers * sum(f.weight.numel() for f, _, _ in calls)
        (w_step, c_step) = _time(lambda: [run(one) for _ in range(layers)], repeats)
        (w_pre, c_pre) = _time(lambda: run(many), max(1, repeats // 10))
        lines.append(f"{name:>8}{'' if sized == shapes else ' (K ' + str([k for _, k in sized]) + ')'}: decode GEMVs ({step_bytes / 1e6:.1f} MB) wall {w_step * 1e3:.2f} ms = "
                     f"{step_bytes / w_step / 1e9:.1f} GB/s, cpu {c_step * 1e3:.2f} ms; {prefill_rows}-row prefill "
                     f"chunk (layers) wall {w_pre * layers * 1e3:.0f} ms, cpu {c_pre * layers * 1e3:.0f} ms")
    return lines


def _in_features(module: nn.Module) -> int:
    if hasattr(module, "in_features"):
        return module.in_features
    if hasattr(module, "nibbles"):
        return module.nibbles.shape[1] * 2
    if hasattr(module, "codes"):
        return module.codes.shape[1]
    return module.weight.shape[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.tools.matmul_bench", description=__doc__)
    parser.add_argument("--model", default=None, help="a .gguf path or known name (default: the bundled model)")
    parser.add_argument("--modes", default="native,int4", help="comma list of weight modes")
    parser.add_argument("--formats", default="", help="comma list of GGUF formats (Q4_0, Q4_K, Q6_K, F16...) "
                        "to time the native kernels in on the model's shapes")
    parser.add_argument("--prefill-rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        lines = bench(args.model, modes, args.prefill_rows, args.repeats) if modes else []
        formats = [f.strip() for f in args.formats.split(",") if f.strip()]
        if formats:
            lines += bench_formats(args.model, formats, args.prefill_rows, args.repeats)
    except ConfigError as e:
        print(f"matmul_bench: {e}", file=sys.stderr)
        return 2
    with open("/proc/loadavg") as f:
        lines.append(f"load average: {f.read().strip()}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
