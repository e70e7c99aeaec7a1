"""The `native` weight mode: every matrix runs on kvserve's kernels over the file's own blocks (fused
parts of different formats included), the tied embedding decodes the same blocks, the model holds
no float copy of its weights, it stays close to float32 on corpus text; and float32's own matrices run
on the F32 rows where the kernels are built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvserve import kernels
from kvserve.kernels import matmul as km
from kvserve.config import CORPUS_PATH, KV_DTYPES, ConfigError
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from kvserve.model.linear import NativeLinear, WeightBuilder
from kvserve.model.llama import LlamaModel
from kvserve.model.loaded import FloatTensor, GGUFTensor
from kvserve.model.runner import ModelRunner

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="native kernels not built")
QKV = [f"model.layers.5.self_attn.{p}_proj.weight" for p in "qkv"]  # Q4_1, q/k rows permuted by llama.cpp


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(bundled_model_path())


def close_to(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y equals x @ w.T within the block formats' activation rounding: each element of x moves by at
    most half its step (`quantize_activations`), so each output by at most |w| @ those half steps,
    plus float32 accumulation."""
    q, d, m = km.quantize_activations(kernels.library(), x)
    half_step = (m.double().view(*x.shape[:-1], -1, 32) * d.double()[..., None]).view(x.shape) / 2
    bound = half_step @ w.double().abs().T + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    return bool(((y.double() - F.linear(x, w).double()).abs() <= bound).all())


def test_fused_qkv_matches_f_linear_over_the_dequantized_weights(loaded):
    wb = WeightBuilder(loaded.tensors, "native", torch.device("cpu"))
    qkv = wb.linear(QKV)
    # one matrix, one call; its rows interleaved for the decode rows (Q4_1's twin, kernels/matmul.py interleave)
    assert isinstance(qkv, NativeLinear) and qkv.qtypes == [int(Q.Q4_1) + 1000]
    w = torch.cat([loaded.tensors[n].dequantize() for n in QKV])
    x = torch.randn(5, w.shape[1])
    assert close_to(qkv(x), x, w)


def test_tied_embedding_decodes_the_files_rows_exactly(loaded):
    embed, head = WeightBuilder(loaded.tensors, "native", torch.device("cpu")).embedding("model.embed_tokens.weight")
    assert embed.table is head and head.qtypes == [int(Q.Q8_0) + 1000]  # interleaved: rows put back in order
    ids = torch.tensor([5, 700, 49151, 5])
    table = loaded.tensors["model.embed_tokens.weight"]
    assert torch.equal(embed(ids), table.dequantize(slice(0, None))[ids])
    x = torch.randn(2, table.shape[1])
    assert close_to(head(x), x, table.dequantize())


def test_parts_of_different_formats_fill_one_output():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 64)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    tensors = {"a": GGUFTensor(quants.quantize(a, Q.Q8_0), Q.Q8_0, (6, 64)),
               "b": GGUFTensor(quants.quantize(b, Q.Q4_0), Q.Q4_0, (4, 64)),
               "c": FloatTensor(torch.from_numpy(a))}
    wb = WeightBuilder(tensors, "native", torch.device("cpu"))
    fused = wb.linear(["a", "b", "c"])
    assert fused.qtypes == [int(Q.Q8_0), int(Q.Q4_0), int(Q.F32)] and fused.out_features == 16
    x = torch.randn(3, 64)
    parts = [wb.linear([n])(x) for n in "abc"]
    assert torch.equal(fused(x), torch.cat(parts, 1))
    assert torch.allclose(parts[2], F.linear(x, torch.from_numpy(a)), rtol=1e-5, atol=1e-5)  # F32: no rounding


def test_the_model_holds_the_files_blocks_not_a_float_copy(loaded):
    model = LlamaModel(loaded.config, loaded.tensors, "native")
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    file_bytes = sum(np.asarray(t.data).nbytes for t in loaded.tensors.values())
    rope_tables = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("cos", "sin")))
    assert held - rope_tables <= file_bytes * 1.01
    assert model.dtype == torch.float32


def test_float32_runs_its_matrices_on_the_f32_rows_in_one_order_whatever_the_rows(loaded, monkeypatch):
    """The exact path's matrices on the kernels' F32 rows: each output reduced in one fixed order (a row
    alone gives the bits it gets among 37), close to F.linear; the tied head reads the embedding's own
    storage; without the kernels, F.linear."""
    builder = WeightBuilder(loaded.tensors, "float32", torch.device("cpu"))
    qkv = builder.linear(QKV)
    assert isinstance(qkv, NativeLinear) and qkv.qtypes == [int(Q.F32)]
    w = torch.cat([loaded.tensors[n].dequantize() for n in QKV])
    x = torch.randn(37, w.shape[1], generator=torch.Generator().manual_seed(5))
    together = qkv(x)
    assert torch.equal(together, torch.cat([qkv(x[i:i + 1]) for i in range(len(x))]))
    assert torch.allclose(together, F.linear(x, w), rtol=1e-5, atol=1e-4)
    embedding, head = builder.embedding("model.embed_tokens.weight")
    assert isinstance(head, NativeLinear) and head.blocks0.data_ptr() == embedding.table.data_ptr()
    monkeypatch.setenv("KVSERVE_KERNELS", "off")
    assert not isinstance(WeightBuilder(loaded.tensors, "float32", torch.device("cpu")).linear(QKV), NativeLinear)


def test_native_without_kernels_is_a_one_line_error(loaded, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "off")
    with pytest.raises(ConfigError, match="--dtype native needs kvserve's native kernels"):
        WeightBuilder(loaded.tensors, "native", torch.device("cpu"))


def test_native_refuses_other_devices(loaded):
    with pytest.raises(ConfigError, match="--dtype native runs on CPU only"):
        WeightBuilder(loaded.tensors, "native", torch.device("meta"))


@pytest.mark.slow
def test_native_agrees_with_float32_on_corpus_text(loaded):
    ids = loaded.tokenizer.encode(CORPUS_PATH.read_text()[:2000], add_special_tokens=False).ids[:96]
    pages = -(-len(ids) // 16) + 1
    logits = {}
    for dtype, kv in (("float32", "fp32"), ("native", "bf16")):
        runner = ModelRunner(loaded, pages, 16, KV_DTYPES[kv], dtype=dtype)
        with torch.inference_mode():
            logits[dtype] = runner.model.compute_logits(runner.forward_sequence(ids))
    agreement = float((logits["float32"].argmax(-1) == logits["native"].argmax(-1)).float().mean())
    assert agreement >= 0.9, agreement
