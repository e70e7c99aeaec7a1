"""The native kernels' tuning for this model on this host (kernels/tuning.py decides; this module hands it
the model's own work to time): one decode step's matmuls over the model's weights, the layers' and the
vocabulary's matrix in the shares a step reads them, and one decode row's attention over a long bf16
context, each larger than the caches so they stream from memory as in serving; the instruction set, where
there is a choice, by the same matmuls on each build, for one row and for a prefill chunk."""

from __future__ import annotations

import dataclasses

import torch

from kvserve import kernels
from kvserve.config import ModelConfig
from kvserve.kernels import api, attention as native_attention, matmul as native_matmul, tuning
from kvserve.model.linear import NativeLinear

STREAM_BYTES = 48 << 20  # more than a last-level cache (32 MB on Zen 4 and Zen 5 CCDs): weights come from DRAM
HEAD_ROWS_STEP = 8  # the vocabulary matrix's rows in whole groups (an interleaved format's FormatInfo.group_rows)
KV_CONTEXT = 2048  # tokens of the attention pass, page_size 16
# the prefill pass: a chunk's rows through ~4 MB of weights (rows enough for the AMX tile, which leaves shorter
# calls to the vector tiles: src/matmul_amx.h AMX_MIN_ROWS)
PREFILL_ROWS, PREFILL_BYTES = 128, 4 << 20
# the chained sums' pass: one row through each interleaved format's first rows, on one thread, from the caches
# (1 MiB: a core's L2 or its L3, where the weights do not stream and compute is timed; a few calls: their
# Python overhead, a few us each, small beside it)
SUMS_BYTES, SUMS_CALLS = 1 << 20, 4


def tune_kernels(model: torch.nn.Module, config: ModelConfig, threads: int) -> tuning.Tuning | None:
    """Chooses and installs the kernels' tuning, the instruction sets first where the CPU runs two SIMD
    builds (the model's linears are moved onto the chosen ones: one for the decode rows, one for more
    rows); the decode rows' build's prefetch choice, with both builds named; None where the model does
    not run on them."""
    linears = [m for m in model.modules() if isinstance(m, NativeLinear)]
    lib = linears[0].library if linears else None
    if lib is None:
        return None
    shape = _shape_key(config, linears)

    head = getattr(model, "lm_head", None)
    layers, head = [m for m in linears if m is not head], head if isinstance(head, NativeLinear) else None

    def prefetch_for(kl: kernels.KernelLibrary) -> tuning.Tuning:
        # the passes are built only if a calibration runs (a cached or forced choice costs nothing)
        return tuning.choose(kl, lambda: _decode_pass(kl, layers, head, threads),
                             lambda: _attention_pass(kl, config, threads), shape, threads,
                             lambda: _sums_passes(kl, linears))

    chosen = prefetch_for(lib)
    isa_lib, row_lib, isa_source = tuning.choose_isa(
        lib, chosen, lambda kl: _step_pass(kl, layers, head, config, threads),
        lambda kl: _prefill_pass(kl, layers, threads), shape, threads)
    for m in linears:
        m.use_library(isa_lib, row_lib)
    # each build its own prefetch choice (cached per build); the decode rows' is the one that matters
    installed = {kl: chosen if kl is lib else prefetch_for(kl) for kl in (isa_lib, row_lib)}
    for kl, choice in installed.items():
        tuning.install(kl, choice)
    return dataclasses.replace(installed[row_lib], isa=isa_lib.isa, decode_isa=row_lib.isa, isa_source=isa_source)


def _shape_key(config: ModelConfig, linears: list[NativeLinear]) -> str:
    formats = sorted({q for m in linears for q in m.qtypes})
    return (f"{config.num_layers} layers, hidden {config.hidden_size}, inter {config.intermediate_size}, "
            f"formats {formats}")


def decode_calls(layers: list[NativeLinear], head: NativeLinear | None, up_to: int = STREAM_BYTES,
                 ) -> list[tuple[int, torch.Tensor, int]]:
    """The decode pass's matmuls as (format, weight rows, in_features): `up_to` bytes in the shares a step
    reads them, the layers' matmuls in order, then the first rows of the vocabulary's matrix (`head`).
    The vocabulary's matrix is a fifth of a step's bytes on Qwen2.5-1.5B and over two thirds on
    Gemma-3-270m; a pass of the first matrices in module order, that matrix first, timed it alone."""
    layer_bytes = sum(_weight_bytes(m) for m in layers)
    head_bytes = 0 if head is None else _weight_bytes(head)
    total = layer_bytes + head_bytes
    if total == 0:
        return []
    calls, read, for_layers = [], 0, up_to * layer_bytes // total
    for m in layers:
        if read >= for_layers:
            break
        calls += [(qtype, m.blocks(i), m.in_features) for i, qtype in enumerate(m.qtypes)]
        read += _weight_bytes(m)
    if head is not None:  # one part: the vocabulary's matrix is one weight of the file
        blocks = head.blocks(0)
        rows = max(1, min(blocks.shape[0], up_to * head_bytes // total // blocks.shape[1]))
        rows = max(HEAD_ROWS_STEP, rows - rows % HEAD_ROWS_STEP)
        calls.append((head.qtypes[0], blocks[:rows], head.in_features))
    return calls


def _weight_bytes(m: NativeLinear) -> int:
    return sum(m.blocks(i).numel() for i in range(len(m.qtypes)))


def _decode_pass(lib: kernels.KernelLibrary, layers: list[NativeLinear], head: NativeLinear | None, threads: int):
    """One activation row through decode_calls' matmuls."""
    return _run_calls(lib, decode_calls(layers, head), threads, 1)


def _step_pass(lib: kernels.KernelLibrary, layers: list[NativeLinear], head: NativeLinear | None,
               config: ModelConfig, threads: int):
    """The decode pass, then the attention pass: the decode rows' build runs the whole fused step, its
    attention too (on Zen 4, Gemma-3-270m's decode matmuls timed 4% faster on AVX2, its decode step ran
    10-15% slower there: docs/performance.md)."""
    matmuls, attention = _decode_pass(lib, layers, head, threads), _attention_pass(lib, config, threads)

    def run() -> None:
        matmuls()
        attention()
    return run


def _prefill_pass(lib: kernels.KernelLibrary, layers: list[NativeLinear], threads: int):
    """PREFILL_ROWS activation rows through the model's first layer matmuls, up to PREFILL_BYTES of
    weights (prefill is bound by compute, not by reading the weights: a few matrices tell the builds
    apart; the vocabulary's matrix is left out)."""
    calls, total = [], 0
    for m in layers:
        for i, qtype in enumerate(m.qtypes):
            if m.blocks(i).numel() <= PREFILL_BYTES:
                calls.append((qtype, m.blocks(i), m.in_features))
                total += m.blocks(i).numel()
        if total >= PREFILL_BYTES:
            break
    return _run_calls(lib, calls, threads, PREFILL_ROWS)


def _run_calls(lib: kernels.KernelLibrary, calls: list[tuple[int, torch.Tensor, int]], threads: int, rows: int):
    """`rows` activation rows through each (format, weight rows, in_features) matmul in turn."""
    prepared = [(native_matmul.PreparedMatmul(lib, qtype, blocks, in_features), torch.randn(rows, in_features),
                 torch.empty(rows, blocks.shape[0])) for qtype, blocks, in_features in calls]

    def run() -> None:
        for call, x, y in prepared:
            call(x, y, threads)
    return run


def _sums_passes(lib: kernels.KernelLibrary, linears: list[NativeLinear]) -> dict:
    """{format name: one activation row through the first SUMS_BYTES of the model's first matrix of that
    interleaved format, SUMS_CALLS times on one thread} for each interleaved format the model reads."""
    firsts: dict[str, tuple[int, torch.Tensor, int]] = {}
    for m in linears:
        for i, qtype in enumerate(m.qtypes):
            fmt = lib.formats[qtype]
            name = api.Format(fmt.base).name
            if fmt.group_rows > 1 and name not in firsts:
                blocks = m.blocks(i)
                rows = min(blocks.shape[0], max(fmt.group_rows, SUMS_BYTES // blocks.shape[1]))
                firsts[name] = (qtype, blocks[:rows - rows % fmt.group_rows], m.in_features)
    return {name: _run_calls(lib, [call] * SUMS_CALLS, 1, 1) for name, call in firsts.items()}


def _attention_pass(lib: kernels.KernelLibrary, config: ModelConfig, threads: int):
    """One decode row at position KV_CONTEXT - 1 attending bf16 pages, layer after layer (each its own
    pages) until STREAM_BYTES / 2 of KV is read."""
    page_size, kv_heads, head_dim = 16, config.num_kv_heads, config.head_dim
    q = torch.randn(1, config.num_heads, head_dim)
    if not native_attention.supports(lib, "bf16", head_dim, q):
        return lambda: None
    pages = KV_CONTEXT // page_size
    layer_bytes = 2 * KV_CONTEXT * kv_heads * head_dim * 2
    layers = max(1, (STREAM_BYTES // 2) // layer_bytes)
    shape = (layers * pages, page_size, kv_heads, head_dim)
    # written, not zeros: untouched zero pages all map one physical page and would never leave the cache
    k, v = torch.full(shape, 0.5, dtype=torch.bfloat16), torch.full(shape, -0.25, dtype=torch.bfloat16)
    no_scales = torch.empty(1, 0)
    one = torch.zeros(1, dtype=torch.int64)
    rows = [native_attention.AttentionRows(torch.tensor([KV_CONTEXT - 1]), one, one,
                                           torch.arange(layer * pages, (layer + 1) * pages), None)
            for layer in range(layers)]

    def run() -> None:
        for r in rows:
            native_attention.paged_attention(lib, q, "bf16", (k, no_scales), (v, no_scales), page_size, r, None,
                                             num_threads=threads)
    return run
