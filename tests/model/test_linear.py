"""Weight modes: int4 reproduces the GGUF's Q4_1 weights from their own blocks, the packed kernels
match F.linear over the same weights, `--dtype auto` resolves per device, and the int4 model stays
close to float32 on corpus text (teacher-forced argmax agreement)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.config import CORPUS_PATH, KV_DTYPES, ConfigError, EngineConfig, resolve_model_dtype
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from kvserve.model.gguf_config import read_gguf_config
from kvserve.model.linear import DEQUANT_ROWS, Int4Linear, Int8Linear, WeightBuilder, int8_rows, q4_blocks
from kvserve.model.runner import ModelRunner
from kvserve.tools.planner import load_model

Q_PROJ = "model.layers.5.self_attn.q_proj.weight"  # Q4_1, rows permuted by llama.cpp
DOWN = "model.layers.7.mlp.down_proj.weight"  # Q4_1, 576 x 1536


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(bundled_model_path())


@pytest.mark.parametrize("name", [Q_PROJ, DOWN])
def test_int4_codes_and_scales_are_the_files_own(loaded, name):
    t = loaded.tensors[name]
    codes, scale, zero = q4_blocks(t)
    assert codes.shape == t.shape and scale.shape == zero.shape == (t.shape[0], t.shape[1] // 32)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    rebuilt = ((codes.float() - 8).view(t.shape[0], -1, 32) * scale[..., None] + zero[..., None]).view(t.shape)
    assert torch.allclose(rebuilt, t.dequantize(), rtol=0, atol=1e-6)  # float rounding only


def test_non_q4_tensors_have_no_int4_blocks(loaded):
    assert q4_blocks(loaded.tensors["model.embed_tokens.weight"]) is None  # Q8_0


def test_packed_kernels_match_f_linear_on_the_same_weights(loaded):
    t = loaded.tensors[DOWN]
    w = t.dequantize()
    x = torch.randn(3, w.shape[1]).bfloat16()
    ref = F.linear(x.float(), w)
    layer = Int4Linear(*q4_blocks(t), None, torch.bfloat16)
    int4 = layer(x).float()
    # bfloat16 scales and output: a few bf16 ulps of the output's size
    assert (int4 - ref).abs().max() < 0.02 * ref.abs().max()
    assert torch.equal(layer.dense(), w.bfloat16())  # the file's weights, rounded once
    many = torch.randn(DEQUANT_ROWS + 1, w.shape[1]).bfloat16()  # a prefill chunk: the dense path
    dense_ref = F.linear(many.float(), w)
    assert (layer(many).float() - dense_ref).abs().max() < 0.02 * dense_ref.abs().max()
    codes, scale = int8_rows(w)
    assert (codes.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7
    int8 = Int8Linear(codes, scale, None, torch.bfloat16)(x).float()
    assert (int8 - ref).abs().max() < 0.03 * ref.abs().max()


def test_int4_mode_builds_int4_layers_and_an_int8_tied_head(loaded):
    wb = WeightBuilder(loaded.tensors, "int4", torch.device("cpu"))
    qkv = wb.linear([f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"])
    assert isinstance(qkv, Int4Linear) and qkv.out_features == 9 * 64 + 2 * 3 * 64
    embed, head = wb.embedding("model.embed_tokens.weight")
    assert isinstance(head, Int8Linear) and embed.table is head
    ids = torch.tensor([5, 700, 49151])
    rows = loaded.tensors["model.embed_tokens.weight"].dequantize(slice(0, None))[ids]
    assert (embed(ids).float() - rows).abs().max() < 0.02 * rows.abs().max()


def test_packed_modes_refuse_other_devices(loaded):
    with pytest.raises(ConfigError, match="--dtype int4 runs on CPU only"):
        WeightBuilder(loaded.tensors, "int4", torch.device("meta"))


def test_auto_dtype_resolves_per_device(monkeypatch):
    expected = "native" if kernels.available() else "int4"
    assert EngineConfig().dtype == resolve_model_dtype("auto", "cpu") == expected
    monkeypatch.setenv("KVSERVE_KERNELS", "off")  # torch's kernels then: int4 (AVX2 and AVX-512 alike)
    assert EngineConfig().dtype == "int4"
    assert EngineConfig(device="cuda:0").dtype == "bfloat16"
    assert EngineConfig(dtype="float32").dtype == "float32"
    with pytest.raises(ConfigError, match="--dtype must be one of auto, float32"):
        EngineConfig(dtype="int3")


def test_loader_and_planner_read_one_config():
    path = bundled_model_path()
    config, num_params = read_gguf_config(path)
    assert config == load_gguf(path).config == load_model(path).config
    assert load_model(path).num_params == num_params


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_packed_modes_agree_with_float32_on_corpus_text(loaded, mode):
    ids = loaded.tokenizer.encode(CORPUS_PATH.read_text()[:2000], add_special_tokens=False).ids[:96]
    pages = -(-len(ids) // 16) + 1
    argmax = {}
    for dtype, kv in (("float32", "fp32"), (mode, "bf16")):
        runner = ModelRunner(loaded, pages, 16, KV_DTYPES[kv], dtype=dtype)
        assert runner.model.dtype == (torch.float32 if dtype == "float32" else torch.bfloat16)
        with torch.inference_mode():
            argmax[dtype] = runner.model.compute_logits(runner.forward_sequence(ids)).argmax(-1)
    agreement = float((argmax["float32"] == argmax[mode]).float().mean())
    assert agreement >= 0.85, agreement
