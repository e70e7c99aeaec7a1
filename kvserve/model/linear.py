"""The decoder's linear layers by weight mode: float weights (F.linear), the GGUF's own blocks run by
kvserve's native kernels (`native`), or the GGUF's quantized weights kept packed for torch's CPU
weight-only kernels (int4 groups of 32, int8 per output row). `WeightBuilder` makes each layer's
module once at load (quantization as a swap of one module type)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.kernels import cuda as gpu
from kvserve.config import ConfigError
from kvserve.kernels import matmul as native_matmul
from kvserve.kernels.api import DECODE_ROWS
from kvserve.model.loaded import FloatTensor, GGUFTensor, unpermute_rope_rows
from kvserve.model.native_fallback import NativeFallback

GROUP = 32  # elements per int4 group: one GGUF Q4 block
PACKED_MODES = ("int4", "int8")
NATIVE_MODE = "native"
EXACT_MODE = "float32"
DEQUANT_ROWS = 256  # Int4Linear: more rows than this run as a dense matmul over the unpacked weight
_EMBED_CHUNK = 4096  # rows dequantized at once while packing the token embedding


def compute_dtype(mode: str) -> torch.dtype:
    """Activation dtype of a weight mode: torch's fast weight-only CPU kernels take bfloat16, the
    native kernels float32."""
    if mode == NATIVE_MODE:
        return torch.float32
    return torch.bfloat16 if mode in PACKED_MODES else getattr(torch, mode)


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_cuda and gpu.invariant_matmul():  # same bits for a row in any batch
            return gpu_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def gpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from kvserve.kernels.cuda.matmul import linear  # triton: imported on the CUDA path only

    return linear(x, weight, bias)


class Int4Linear(nn.Module):
    """w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], g = k // 32; q packed two per byte.

    Up to DEQUANT_ROWS rows (decode) run torch's int4 kernel; longer inputs (prefill chunks) unpack
    the weight to the compute dtype and run one dense matmul, because the int4 kernel's cost grows
    with the rows faster than a bfloat16 matmul's: 30 ms against 19.5 ms (unpack included) for 512
    rows of gate+up on one core (docs/performance.md)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, in_features = codes.shape
        codes = codes.to(torch.uint8)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1))  # [out, in / 2] uint8, the kernel's layout
        self.register_buffer("scales_zeros",  # [in / 32, out, 2] as the kernel reads them
                             torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype))
        # the same codes in a layout cheap to unpack: byte j holds column j (low) and j + in/2 (high)
        half = in_features // 2
        self.register_buffer("nibbles", codes[:, :half] | (codes[:, half:] << 4))  # [out, in / 2]
        # float32 (Q4's fp16 d and m exactly): the unpacked weight is rounded once, to the compute dtype
        self.register_buffer("scale_g", scale.float()[..., None])  # [out, in / 32, 1]
        self.register_buffer("zero_g", (zero - 8 * scale).float()[..., None])  # w = q * scale + zero_g
        self.dtype = dtype
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= DEQUANT_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        else:
            y = F.linear(x, self.dense())
        return y if self.bias is None else y + self.bias

    def dense(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype (scratch for one prefill matmul)."""
        q = torch.cat([self.nibbles & 0x0F, self.nibbles >> 4], 1).float()  # [out, in]
        q = q.view(self.out_features, -1, GROUP)
        return torch.addcmul(self.zero_g, q, self.scale_g).view(self.out_features, -1).to(self.dtype)


class Int8Linear(nn.Module):
    """w[n, k] = q[n, k] * scale[n]; also the token embedding when tied (`embed` looks rows up)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features = codes.shape[0]
        self.register_buffer("codes", codes.contiguous())  # [out, in] int8
        self.register_buffer("scale", scale.to(dtype))  # [out]
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)
        return y if self.bias is None else y + self.bias

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].to(self.scale.dtype) * self.scale[ids, None]


class NativeLinear(nn.Module):
    """y = x @ W^T over the file's own blocks, run by kvserve's native kernels in float32. The
    weight's parts stacked by rows (fused QKV, gate+up) each keep their own format and fill their
    columns of one output; also the token embedding when tied (`embed` decodes the looked-up rows).
    Float formats (F32, F16, BF16) take float32 activations; block formats round each activation row once
    to int8 blocks of 32 (src/matmul_int8.h) and multiply on integers, with float32 out."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None,
                 library: kernels.KernelLibrary) -> None:
        super().__init__()
        self.in_features, self.library = in_features, library
        self.qtypes = [int(q) for q, _ in parts]
        self.widths = [int(b.shape[0]) for _, b in parts]
        self.out_features = sum(self.widths)
        for i, (_, blocks) in enumerate(parts):
            self.register_buffer(f"blocks{i}", blocks)  # [rows, row bytes] uint8: the file's layout or its twin's
        self.register_buffer("bias", None if bias is None else bias.float())
        self.row_library = library  # the build that runs calls of up to DECODE_ROWS rows
        self._calls: dict[kernels.KernelLibrary, list[native_matmul.PreparedMatmul]] = {}

    def blocks(self, i: int) -> torch.Tensor:
        return getattr(self, f"blocks{i}")

    @property
    def libraries(self) -> tuple[kernels.KernelLibrary, ...]:
        return (self.library, self.row_library)

    def use_library(self, library: kernels.KernelLibrary, row_library: kernels.KernelLibrary | None = None) -> None:
        """Runs on another build of the kernels from now on (the instruction set's calibration), calls of
        up to DECODE_ROWS rows on `row_library` if given (the same bits on either)."""
        self.library, self.row_library, self._calls = library, row_library or library, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        library = self.row_library if x.shape[0] <= DECODE_ROWS else self.library
        calls = self._calls.get(library)
        if calls is None:  # made on first use: the buffers' storage is final by then
            calls = self._calls[library] = [native_matmul.PreparedMatmul(library, q, self.blocks(i), self.in_features)
                                            for i, q in enumerate(self.qtypes)]
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        threads = torch.get_num_threads()
        if len(calls) == 1:
            calls[0](x, y, threads)
        else:
            col = 0
            for call, width in zip(calls, self.widths):
                call(x, y[:, col:col + width], threads)
                col += width
        return y if self.bias is None else y + self.bias

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert len(self.qtypes) == 1
        rows = native_matmul.dequantize_rows(self.library, self.qtypes[0], self.blocks0, self.in_features,
                                             ids.reshape(-1))
        return rows.view(*ids.shape, self.in_features)


class Embedding(nn.Module):
    """Token embedding over a float matrix or a packed head's rows (tied lm_head shares it)."""

    def __init__(self, table: torch.Tensor | Int8Linear | NativeLinear) -> None:
        super().__init__()
        packed = isinstance(table, (Int8Linear, NativeLinear))
        self.table = table if packed else nn.Parameter(table, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, (Int8Linear, NativeLinear)):
            return self.table.embed(ids)
        return F.embedding(ids, self.table)


def q4_blocks(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A Q4_0/Q4_1 tensor's own codes [out, in] (0..15) and per-block scale and zero [out, in / 32]
    in Int4Linear's form, read from the block bytes without rounding; None for other types."""
    from gguf import GGMLQuantizationType as Q

    if t.qtype not in (Q.Q4_0, Q.Q4_1):
        return None
    rows, cols = t.shape
    header = 4 if t.qtype == Q.Q4_1 else 2  # fp16 d (+ fp16 m for Q4_1), then 16 bytes of nibbles
    blocks = np.asarray(t.data).reshape(rows, cols // GROUP, header + GROUP // 2)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    # element j of a block is the low nibble of byte j, element j + 16 the high nibble
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    if t.qtype == Q.Q4_1:  # w = d * q + m = (q - 8) * d + (m + 8 d)
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    else:  # Q4_0: w = d * (q - 8)
        zero = np.zeros_like(d)
    out = [torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, d, zero)]
    if t.rope_heads is not None:
        out = [unpermute_rope_rows(a, t.rope_heads) for a in out]
    return out[0], out[1], out[2]


def native_blocks(t: GGUFTensor | FloatTensor, library: kernels.KernelLibrary) -> tuple[int, torch.Tensor]:
    """(ggml type, [rows, row bytes] uint8) of a matrix as the native kernels read it: the file's own
    blocks copied from the file (rows in HF order), or a float32 matrix's bytes as F32."""
    if isinstance(t, FloatTensor):
        return 0, t.value.float().contiguous().view(torch.uint8)
    qtype = int(t.qtype)
    if not native_matmul.supported(library, qtype):
        raise ConfigError(f"--dtype native has no kernel for ggml type {t.qtype.name}; use --dtype int8")
    rows, cols = t.shape
    data = t.copy_data().view(np.uint8).reshape(rows, -1)
    assert data.shape[1] == native_matmul.row_bytes(library, qtype, cols), (t.shape, data.shape)
    blocks = torch.from_numpy(data)
    if t.rope_heads is not None:
        blocks = unpermute_rope_rows(blocks, t.rope_heads)
    return qtype, blocks


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (codes [out, in] int8, scale [out] float32)."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class WeightBuilder:
    """Builds the decoder's modules for one weight mode from a LoadedModel's stored tensors; every
    module maps [T, in] -> [T, out] in the mode's compute dtype. Packed modes read the blocks
    directly: no float32 copy of the whole model is made.

        float32 / bfloat16 / float16   dequantized weights in that dtype (float32: the exact path, on CPU
               run by the native kernels' F32 rows where they are built, F.linear without them)
        int4   Q4_0/Q4_1 blocks as int4 groups of 32 (the file's own codes and scales), the rest (the
               Q8_0 token embedding = tied lm_head, other types) as int8 per row; bfloat16 activations
        int8   every matrix as int8 per row; bfloat16 activations
        native every matrix in its own GGUF format (float folders' weights as F32) run by kvserve's
               native kernels; float32 activations
    """

    def __init__(self, tensors: dict[str, GGUFTensor], mode: str, device: torch.device) -> None:
        if mode in PACKED_MODES and device.type != "cpu":
            raise ConfigError(f"--dtype {mode} runs on CPU only (torch's weight-only CPU kernels); "
                              "use --dtype bfloat16 on this device")
        self.library = None
        if mode == EXACT_MODE and device.type == "cpu":
            # the exact path's float32 matrices on the native kernels' F32 rows where they are built: one
            # fixed reduction order per output whatever the rows, and a decode step ~2.4x faster than
            # torch's float32 GEMV (docs/performance.md); None (kernels off): F.linear
            self.library = kernels.library()
        elif mode == NATIVE_MODE:
            if device.type != "cpu":
                raise ConfigError("--dtype native runs on CPU only (kvserve's native kernels); "
                                  "use --dtype bfloat16 on this device")
            self.library = kernels.library()
            if self.library is None:
                raise ConfigError("--dtype native needs kvserve's native kernels (built by `make install`, "
                                  "not disabled by KVSERVE_KERNELS=off); use --dtype int4 or float32")
        self.tensors, self.mode, self.device = tensors, mode, device
        self.fallback = NativeFallback()
        self.dtype = compute_dtype(mode)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A small float tensor (norm weights, biases) in the compute dtype (or `dtype`)."""
        return self.tensors[name].dequantize().to(self.device, dtype or self.dtype)

    def linear(self, names: list[str], biases: list[str] | None = None) -> nn.Module:
        """One module for the weights `names` stacked by rows (fused QKV, gate+up)."""
        bias = self._bias(names, biases or [])
        parts = [self.tensors[n] for n in names]
        if self.mode == NATIVE_MODE:
            return self._native(parts, bias)
        if self.mode == "int4":
            blocks = [q4_blocks(t) for t in parts]
            if all(b is not None for b in blocks):
                codes, scale, zero = (torch.cat(x) for x in zip(*blocks))
                return Int4Linear(codes, scale, zero, bias, self.dtype)
        w = torch.cat([t.dequantize() for t in parts])
        if self.mode in PACKED_MODES:
            return Int8Linear(*int8_rows(w), bias, self.dtype)
        if self.library is not None:
            return self._float_native(w, bias)
        return Linear(w.to(self.device, self.dtype), bias)

    def embedding(self, name: str) -> tuple[Embedding, nn.Module]:
        """(token embedding, the lm_head made from the same matrix) for tied embeddings."""
        if self.mode == NATIVE_MODE:
            head = self._native([self.tensors[name]], None)
            return Embedding(head), head
        if self.mode not in PACKED_MODES:
            table = nn.Parameter(self.tensor(name), requires_grad=False)
            return Embedding(table), (Linear(table) if self.library is None else self._float_native(table.data))
        t = self.tensors[name]
        codes, scales = [], []
        for start in range(0, t.shape[0], _EMBED_CHUNK):  # bounded float32 scratch
            c, s = int8_rows(t.dequantize(slice(start, start + _EMBED_CHUNK)))
            codes.append(c)
            scales.append(s)
        head = Int8Linear(torch.cat(codes), torch.cat(scales), None, self.dtype)
        return Embedding(head), head

    def _native(self, parts: list[GGUFTensor], bias: torch.Tensor | None) -> NativeLinear:
        """Parts of one format next to each other share one block matrix (one kernel call)."""
        merged: list[tuple[int, list[torch.Tensor]]] = []
        for qtype, blocks in (self._native_part(p) for p in parts):  # one tensor at a time
            if merged and merged[-1][0] == qtype:
                merged[-1][1].append(blocks)
            else:
                merged.append((qtype, [blocks]))
        joined = [(q, b[0] if len(b) == 1 else torch.cat(b)) for q, b in merged]
        return NativeLinear(joined, parts[0].shape[1], bias, self.library)

    def _float_native(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> NativeLinear:
        """A float32 matrix as F32 rows of the native kernels (its own storage: no copy)."""
        return NativeLinear([native_blocks(FloatTensor(w), self.library)], w.shape[1], bias, self.library)

    def _native_part(self, t: GGUFTensor | FloatTensor) -> tuple[int, torch.Tensor]:
        if isinstance(t, FloatTensor) or native_matmul.supported(self.library, int(t.qtype)):
            qtype, blocks = native_blocks(t, self.library)
            return native_matmul.interleave(self.library, qtype, blocks, t.shape[1])
        return self.fallback.blocks(t)  # a format without a kernel: requantized, and said once

    def _bias(self, names: list[str], biases: list[str]) -> torch.Tensor | None:
        if not any(b in self.tensors for b in biases):
            return None
        rows = [self.tensors[n].shape[0] for n in names]
        return torch.cat([self.tensor(b) if b in self.tensors else torch.zeros(r, dtype=self.dtype,
                                                                                device=self.device)
                          for b, r in zip(biases, rows)])
