"""ModelRunner: owns the model and the paged KV tensors, and turns one SchedulerOutput into a
StepResult: page moves (saves, loads, copies) -> flat batch tensors + attention metadata -> decoder ->
logits for sampled rows -> sampler.

All layers' caches live in one tensor, so page copies and tier transfers are one indexing op:

    kv[num_layers, 2 (K, V), num_pages, page_size, num_kv_heads, head_dim]
    layer l uses kv[l, 0] as K cache and kv[l, 1] as V cache

Quantized KV dtypes (fp8, int8, int4) store codes in `kv` (int4: head_dim / 2 bytes) plus
`kv_scales[num_layers, 2, num_pages, n]` (int8/int4: n = num_kv_heads; float and fp8: n = 0), made by
the codec of kvserve/model/kv_quant.py; each layer gets PagedKV views that attention writes and reads
through, whatever the dtype. A page's payload for the tiers is its bytes: codes, then scales.

With the hybrid allocator (sliding-window models, cache/window.py) the windowed layers' K/V live in a
second pair of tensors, `window_kv` [num_windowed_layers, 2, num_window_slots, ...], addressed by each
sequence's window block table; `kv` then holds only the full-attention layers.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from kvserve import kernels
from kvserve.config import CORPUS_PATH, KV_DTYPES, KVDtype, resolve_model_dtype
from kvserve.model.attention import AttentionMetadata
from kvserve.model.gguf_loader import LoadedModel
from kvserve.model.host_heap import retain_freed_memory
from kvserve.model.kernel_tuning import tune_kernels
from kvserve.model import gpu_attention
from kvserve.model.cuda_graphs import DecodeBuffers, DecodeGraphs, buckets_up_to
from kvserve.model.flat_batch import FlatBatch
from kvserve.model.gpu_attention import GpuAttentionMetadata
from kvserve.model.kv_quant import KVCodec, PagedKV, codec_for, fp8_scale_for
from kvserve.model.llama import LlamaModel
from kvserve.batch import DraftSeq, PageOps, SampledToken, ScheduledSeq, SchedulerOutput, StepResult
from kvserve.request import PromptLogprob
from kvserve.model.sampler import sample
from kvserve.model.spec_verify import verify

SEQUENCE_CHUNK = 512  # forward_sequence's tokens per pass: bounds attention scores' memory
CALIBRATION_TOKENS = 512  # corpus tokens of the fp8 calibration pass (--calculate-kv-scales)
PROMPT_LOGPROBS_BLOCK = 128  # prompt rows whose logits are held at once (128 x a 152k vocabulary: 78 MB)
ROPE_MIN_POSITIONS = 8192  # the smallest RoPE table build_model makes: 2 x 4 MiB at head_dim 128 (float32)


def configure_threads(threads: int | None = None) -> None:
    """torch's threads for this process: `threads` when given, else $OMP_NUM_THREADS when set, else
    every core this process may run on."""
    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


class Drafter(Protocol):
    """A draft model (draft_model.DraftModel): proposes the drafts of the step's draft work."""

    def propose(self, work: list[DraftSeq]) -> list[list[int]]: ...

    def kv_cache_bytes(self) -> int: ...


def build_model(loaded: LoadedModel, dtype: str, device: str, max_model_len: int | None = None) -> LlamaModel:
    """One model per (weights, weight mode, device, RoPE bucket) in a process: the model holds no
    per-request state. Its RoPE tables cover at least max_model_len positions (None: the model's context)."""
    context = loaded.config.max_position_embeddings
    # the weights' layout (kernels/matmul.py interleave) is part of what a built model holds
    return _build_model(loaded, dtype, device, rope_positions(max_model_len or context, context),
                        kernels.interleave_enabled())


def rope_positions(max_model_len: int, context: int) -> int:
    """The RoPE tables' rows for max_model_len: the next power of two, at least ROPE_MIN_POSITIONS, at
    most the model's context. A table's row p does not depend on the table's length (the same bits in
    any longer table), so engines of nearby max_model_len share one cached model rather than each
    copying the weights again (tests/model and six engine test files: 95 builds, 23 s, became 62, 9 s)."""
    return min(context, max(ROPE_MIN_POSITIONS, 1 << (max_model_len - 1).bit_length()))


@functools.lru_cache(maxsize=4)
def _build_model(loaded: LoadedModel, dtype: str, device: str, max_positions: int, interleaved: bool) -> LlamaModel:
    return LlamaModel(loaded.config, loaded.tensors, dtype, device, max_positions).eval()


build_model.cache_clear = _build_model.cache_clear  # (frees the cached models: tests/cuda/gpu_check.py)


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, num_pages: int, page_size: int, kv_dtype: KVDtype,
        device: str = "cpu", dtype: str = "float32", fp8_scale: float = 1.0, num_window_slots: int = 0,
        threads: int | None = None, drafter: Drafter | None = None, attention: str = "auto",
        decode_graphs_batch: int = 0, max_model_len: int = 0,
    ) -> None:
        """`attention`: auto (the Triton kernel on CUDA where the codec allows, else the CPU's
        native kernels or the torch reference), triton (also on the CPU, interpreted: tests), torch.
        `decode_graphs_batch` > 0 on the Triton CUDA path: decode steps of up to that many rows (of
        contexts up to max_model_len) replay CUDA graphs captured here (model/cuda_graphs.py)."""
        self.drafter = drafter  # speculative method draft_model: proposes drafts before each step
        dtype = resolve_model_dtype(dtype, device)  # ConfigError for an unknown name
        configure_threads(threads)
        if torch.device(device).type == "cpu":
            retain_freed_memory()
        cfg = loaded.config
        self.config = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        self.model = build_model(loaded, dtype, str(self.device), max_model_len or None)
        # the native kernels' prefetch choices for this host (speed only, never bits)
        self.kernel_tuning = tune_kernels(self.model, cfg, torch.get_num_threads()) if self.device.type == "cpu" \
            else None
        # zeros, not empty: padded reads of the null page 0 must be finite (masked, but 0 * NaN = NaN)
        self.codec = codec_for(kv_dtype, self.model.dtype, fp8_scale=fp8_scale)
        self.triton_attention = choose_triton_attention(attention, self.device, self.codec)
        windowed = [cfg.layer_window(i) is not None for i in range(cfg.num_layers)] if num_window_slots \
            else [False] * cfg.num_layers
        self.kv, self.kv_scales = self.codec.make_cache(
            num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, self.device,
            num_layers=windowed.count(False))
        self.window_kv, self.window_kv_scales = self.codec.make_cache(
            num_window_slots, page_size, cfg.num_kv_heads, cfg.head_dim, self.device,
            num_layers=windowed.count(True))
        self.hybrid = bool(num_window_slots)
        self.kv_caches = []
        for layer, in_window in enumerate(windowed):
            kv, scales = (self.window_kv, self.window_kv_scales) if in_window else (self.kv, self.kv_scales)
            i = windowed[:layer].count(in_window)
            self.kv_caches.append(tuple(PagedKV(self.codec, kv[i, j], scales[i, j]) for j in (0, 1)))
        self._kv_bytes, self._window_kv_bytes = self._as_bytes(self.kv), self._as_bytes(self.window_kv)
        self.decode_graphs = None
        if decode_graphs_batch and self.triton_attention and self.device.type == "cuda":
            buffers = DecodeBuffers.allocate(decode_graphs_batch, -(-max_model_len // page_size), page_size,
                                             self.device, self.hybrid)
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, buffers,
                                              buckets_up_to(decode_graphs_batch))

    @staticmethod
    def _as_bytes(kv: torch.Tensor) -> torch.Tensor:
        """fp8 tensors have no index_copy_ kernel: page copies move their bytes."""
        return kv.view(torch.uint8) if kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else kv

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Apply the step's page moves, then run its sequences; `sampled` is aligned with out.seqs
        (None where need_sample is False); `accepted` too where any sequence carried drafts."""
        saved = self.apply_page_ops(out.page_ops)
        if not out.seqs:
            return StepResult([], saved)
        sampled, accepted, prompt_logprobs = self._run(self._with_drafts(out.seqs))
        return StepResult(sampled, saved, accepted, prompt_logprobs)

    def _with_drafts(self, seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The draft model's proposals appended to the sequences that carry draft work, as the last
        rows the target computes and verifies (the draft model computes its own rows first)."""
        if self.drafter is None or all(s.draft is None for s in seqs):
            return seqs
        proposals = iter(self.drafter.propose([s.draft for s in seqs if s.draft is not None]))
        with_drafts = []
        for seq in seqs:
            drafts = next(proposals) if seq.draft is not None else []
            with_drafts.append(replace(seq, token_ids=seq.token_ids + drafts, draft_token_ids=drafts)
                               if drafts else seq)
        return with_drafts

    def apply_page_ops(self, ops: PageOps) -> list[np.ndarray]:
        """Saves (read first: nothing has written those pages yet), then loads, then copies.
        Returns the saved pages' payloads, in order."""
        saved = self.read_page_bytes([page for page, _ in ops.saves]) if ops.saves else []
        if ops.loads:
            self.write_page_bytes(ops.loads)
        if ops.copies:
            self.copy_pages(ops.copies)
        if ops.window_copies:
            self._copy(self._window_kv_bytes, self.window_kv_scales, ops.window_copies)
        return saved

    def _run(self, seqs: list) -> tuple[list[SampledToken | None], list[list[SampledToken]],
                                         list[list[PromptLogprob] | None]]:
        query_lens = [len(s.token_ids) for s in seqs]
        assert min(query_lens) > 0, "a scheduled sequence has no tokens"
        starts = [s.start_pos for s in seqs]
        rows = [i for i, s in enumerate(seqs) if s.need_sample]
        result: list[SampledToken | None] = [None] * len(seqs)
        accepted: list[list[SampledToken]] = []
        with torch.inference_mode():
            hidden = self._forward(seqs, starts, query_lens)  # [T, hidden]
            prompt_logprobs = self._prompt_logprobs(seqs, query_lens, hidden)
            if not rows:
                return result, accepted, prompt_logprobs
            # a sampled sequence's last row, and before it one row per draft token it carries
            ends = list(itertools.accumulate(query_lens))
            counts = [1 + len(seqs[i].draft_token_ids) for i in rows]
            picked = [r for i, n in zip(rows, counts) for r in range(ends[i] - n, ends[i])]
            # (each row picked, one step's decode: the rows as they are, no gather, no copy of the logits)
            logits = self.model.compute_logits(hidden if len(picked) == hidden.shape[0] else hidden.index_select(
                0, torch.tensor(picked, device=self.device)))  # [sum(counts), vocab]
            offsets = list(itertools.accumulate(counts, initial=0))
            plain = [r for r, i in enumerate(rows) if counts[r] == 1]
            if plain:
                tokens = sample(logits if len(plain) == logits.shape[0] else
                                logits[torch.tensor([offsets[r] for r in plain], device=self.device)],
                                [seqs[rows[r]] for r in plain])
                for r, token in zip(plain, tokens):
                    result[rows[r]] = token
            if len(plain) < len(rows):
                accepted = [[] for _ in seqs]
                for r, i in enumerate(rows):
                    if counts[r] > 1:
                        *accepted[i], result[i] = verify(logits[offsets[r]:offsets[r + 1]], seqs[i])
        return result, accepted, prompt_logprobs

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], query_lens: list[int], hidden: torch.Tensor
                         ) -> list[list[PromptLogprob] | None]:
        """prompt_logprobs: at each row with a prompt target, the log-softmax of the raw logits at that
        target, its rank, and the most likely tokens; the rows in blocks, so the logits stay small."""
        asked = [i for i, s in enumerate(seqs) if s.prompt_targets]
        if not asked:
            return []
        firsts = list(itertools.accumulate(query_lens, initial=0))
        rows = [(i, firsts[i] + j, t) for i in asked for j, t in enumerate(seqs[i].prompt_targets)]
        out: list[list[PromptLogprob] | None] = [None] * len(seqs)
        for i in asked:
            out[i] = []
        for block in range(0, len(rows), PROMPT_LOGPROBS_BLOCK):
            part = rows[block:block + PROMPT_LOGPROBS_BLOCK]
            picked = torch.tensor([r for _, r, _ in part], device=self.device)
            logp = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, picked)).float(), dim=-1)
            target_logp = logp.gather(1, torch.tensor([t for _, _, t in part], device=self.device)[:, None])
            ranks = ((logp > target_logp).sum(dim=1) + 1).tolist()
            k = min(max(seqs[i].sampling_params.prompt_logprobs for i, _, _ in part), logp.shape[-1])
            top_vals, top_ids = (v.tolist() for v in logp.topk(k, dim=-1)) if k else ([[]] * len(part),) * 2
            for r, ((i, _, target), value) in enumerate(zip(part, target_logp[:, 0].tolist())):
                kk = seqs[i].sampling_params.prompt_logprobs
                out[i].append(PromptLogprob(target, value, ranks[r], dict(zip(top_ids[r][:kk], top_vals[r][:kk]))))
        return out

    def _forward(self, seqs: list[ScheduledSeq], starts: list[int], query_lens: list[int]) -> torch.Tensor:
        """The decoder over the step's rows -> final hidden states [T, hidden]: a captured graph's
        replay for a decode-only step that fits one, else eager."""
        graphs = self.decode_graphs
        if graphs is not None and len(seqs) == sum(query_lens) and graphs.bucket_for(len(seqs)) is not None:
            flat = FlatBatch.build(starts, query_lens, [s.block_table for s in seqs], self.page_size)
            window_flat = FlatBatch.build(starts, query_lens, [s.window_block_table for s in seqs],
                                          self.page_size) if self.hybrid else None
            return graphs.run([s.token_ids[0] for s in seqs], flat, window_flat)
        meta = self._metadata(starts, query_lens, [s.block_table for s in seqs])
        window_meta = None
        if self.hybrid:
            window_meta = self._metadata(starts, query_lens, [s.window_block_table for s in seqs])
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64,
                                 device=self.device)  # [T]
        return self.model(input_ids, meta.positions, self.kv_caches, meta, window_meta)

    def _metadata(self, starts: list[int], query_lens: list[int], block_tables: list[list[int]],
                  ) -> AttentionMetadata | GpuAttentionMetadata:
        kind = GpuAttentionMetadata if self.triton_attention else AttentionMetadata
        return kind.build(starts, query_lens, block_tables, self.page_size, self.device)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page src -> dst in every layer, K and V (copy-on-write of a shared partial page)."""
        self._copy(self._kv_bytes, self.kv_scales, pairs)

    def _copy(self, kv: torch.Tensor, scales: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        kv.index_copy_(2, dst, kv.index_select(2, src))
        scales.index_copy_(2, dst, scales.index_select(2, src))

    def read_pages(self, page_ids: list[int]) -> torch.Tensor:
        """-> CPU uint8 tensor [n, page_bytes]; row i holds page page_ids[i] across all layers, K and
        V: its codes, then its scales (none for float dtypes)."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        n = len(page_ids)
        data = self._kv_bytes.index_select(2, ids).movedim(2, 0).contiguous().cpu()
        scales = self.kv_scales.index_select(2, ids).movedim(2, 0).contiguous().cpu()
        return torch.cat([data.view(torch.uint8).reshape(n, -1), scales.view(torch.uint8).reshape(n, -1)], 1)

    def write_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_pages: data uint8 [n, page_bytes]."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        n, split = len(page_ids), self.kv[:, :, 0].nbytes
        codes = data[:, :split].contiguous().view(self._kv_bytes.dtype).reshape(n, *self._kv_bytes[:, :, 0].shape)
        scales = data[:, split:].contiguous().view(torch.float32).reshape(n, *self.kv_scales[:, :, 0].shape)
        self._kv_bytes.index_copy_(2, ids, codes.to(self.device).movedim(0, 2))
        self.kv_scales.index_copy_(2, ids, scales.to(self.device).movedim(0, 2))

    def read_page_bytes(self, page_ids: list[int]) -> list[np.ndarray]:
        """Each page's bytes (read_pages) as a flat uint8 array, for the host and Redis tiers. The
        arrays are views of one fresh buffer: later steps cannot change them."""
        return list(self.read_pages(page_ids).numpy())

    def write_page_bytes(self, loads: list[tuple[int, Any]]) -> None:
        """Inverse of read_page_bytes: (page_id, bytes-like payload) pairs into the KV cache."""
        buf = np.empty((len(loads), self.page_bytes), np.uint8)
        for row, (_, payload) in zip(buf, loads):
            row[:] = np.frombuffer(payload, np.uint8)
        self.write_pages([page for page, _ in loads], torch.from_numpy(buf))

    @classmethod
    def for_one_sequence(cls, loaded: LoadedModel, kv_dtype: str, num_tokens: int, page_size: int,
                         fp8_scale: float = 1.0) -> ModelRunner:
        """A runner whose pool holds exactly one sequence of num_tokens (for forward_sequence)."""
        return cls(loaded, -(-num_tokens // page_size) + 1, page_size, KV_DTYPES[kv_dtype],
                   fp8_scale=fp8_scale)

    def forward_sequence(self, token_ids: list[int], start: int = 0, chunk: int = SEQUENCE_CHUNK) -> torch.Tensor:
        """Compute token_ids at positions start.. of one sequence whose pages are 1, 2, ... (no
        scheduler: eval-kv and calibration) -> final hidden states [len(token_ids), hidden]."""
        ps = self.page_size
        block_table = list(range(1, -(-(start + len(token_ids)) // ps) + 1))
        hidden = []
        with torch.inference_mode():
            for i in range(0, len(token_ids), chunk):
                ids = token_ids[i:i + chunk]
                meta = self._metadata([start + i], [len(ids)], [block_table])
                ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
                hidden.append(self.model(ids, meta.positions, self.kv_caches, meta))
        return torch.cat(hidden)

    def kv_amax(self, num_tokens: int) -> float:
        """Largest |K| or |V| in pages 1.. of a float KV cache after forward_sequence(num_tokens)."""
        return float(self.kv[:, :, 1:-(-num_tokens // self.page_size) + 1].abs().max())

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V, scales included (= config.kv_bytes_per_page)."""
        return (self.kv.nbytes + self.kv_scales.nbytes) // self.num_pages

    @property
    def window_page_bytes(self) -> int:
        """Bytes of one window-pool page across the sliding-window layers (0 without the pool)."""
        return (self.window_kv.nbytes + self.window_kv_scales.nbytes) // max(1, self.window_kv.shape[2])

    def kv_cache_bytes(self) -> int:
        """The KV tensors' bytes, a draft model's included."""
        draft = self.drafter.kv_cache_bytes() if self.drafter is not None else 0
        return self.kv.nbytes + self.kv_scales.nbytes + self.window_kv.nbytes + self.window_kv_scales.nbytes + draft


def profile_step(loaded: LoadedModel, dtype: str, device: str, kv_dtype: KVDtype, page_size: int,
                 num_tokens: int, num_sampled: int) -> int:
    """One step of num_tokens prompt rows, and logits for num_sampled of them, through a scratch
    pool of exactly those tokens (the GPU's activation peak, model/gpu_memory.py). Returns the
    scratch pool's bytes."""
    runner = ModelRunner(loaded, -(-num_tokens // page_size) + 1, page_size, kv_dtype, device=device, dtype=dtype)
    hidden = runner.forward_sequence([0] * num_tokens, chunk=num_tokens)
    runner.model.compute_logits(hidden[-num_sampled:])
    return runner.kv_cache_bytes()


def choose_triton_attention(attention: str, device: torch.device, codec: KVCodec) -> bool:
    """The one place that picks the attention path: True for the Triton kernel (CUDA, or asked for)."""
    if attention not in ("auto", "triton", "torch"):
        raise ValueError(f"attention must be auto, triton or torch, got {attention!r}")
    if attention == "triton" and not gpu_attention.supports(codec):
        raise ValueError(f"the Triton attention kernel does not read {codec.name} pages (or triton is missing)")
    return attention == "triton" or (attention == "auto" and device.type == "cuda" and gpu_attention.supports(codec))


def calibrate_fp8_scale(loaded: LoadedModel, kv_dtype: str, page_size: int = 16,
                        num_tokens: int = CALIBRATION_TOKENS) -> float:
    """The per-tensor fp8 scale of a start-up calibration pass: the largest |K| or |V| the model
    writes for the first `num_tokens` tokens of the bundled corpus, over the fp8 format's maximum."""
    text = CORPUS_PATH.read_text()[:num_tokens * 8]
    ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
    runner = ModelRunner.for_one_sequence(loaded, "fp32", len(ids), page_size)
    runner.forward_sequence(ids)
    return fp8_scale_for(runner.kv_amax(len(ids)), codec_for(kv_dtype).storage_dtype)
