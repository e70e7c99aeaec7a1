"""Micro-benchmark of a model's matmuls by weight mode: the GEMVs of one decode step (every layer's
QKV, O, gate+up and down, then the lm_head) and one prefill chunk, with the bandwidth against the
bytes the weights occupy. `python -m kvserve.tools.matmul_bench [--model M] [--modes native,int4]`."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from kvserve.config import ConfigError


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
    parser.add_argument("--prefill-rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lines = bench(args.model, [m.strip() for m in args.modes.split(",") if m.strip()], args.prefill_rows,
                      args.repeats)
    except ConfigError as e:
        print(f"matmul_bench: {e}", file=sys.stderr)
        return 2
    with open("/proc/loadavg") as f:
        lines.append(f"load average: {f.read().strip()}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
