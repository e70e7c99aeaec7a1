"""A loaded model, whatever file it came from: its ModelConfig, its tensors as stored (GGUF blocks or
float32 safetensors, under Hugging Face names), its tokenizer, chat template and stop ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kvserve.config import ConfigError, ModelConfig
from kvserve.model.generic_tools import template_reads_tools, with_generic_tools
from kvserve.model.tokenizer import ChatTemplateOptions, Encoded, apply_chat_template, encode_prompt


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor as the file stores it: `data` is the memory-mapped bytes, [rows, row bytes] for
    block-quantized types. `rope_heads` is set for Q/K rows that llama.cpp permuted (undone on use)."""

    data: np.ndarray
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: [out, in]
    rope_heads: int | None = None
    offset: float = 0.0  # subtracted on use: Gemma's norm weights are stored as 1 + w
    source: tuple[str, int] | None = None  # (file, offset of `data` in it)

    def copy_data(self) -> np.ndarray:
        """A writable copy of `data`, read from the file when its place is known: copying through
        the memory map would leave the file's pages resident beside the copy (twice the bytes)."""
        if self.source is None:
            return np.array(self.data, copy=True)
        # in torch's allocator, which puts blocks of 2 MB and more on transparent huge pages (kvserve/__init__):
        # a decode step streams every weight once, and on 4 KB pages the TLB misses cost the native decode rows
        # 1.3x (Q4_1 from DRAM, one thread, Zen 4: 6.5 -> 8.3 GB/s)
        out = torch.empty(self.data.nbytes, dtype=torch.uint8).numpy().view(self.data.dtype).reshape(self.data.shape)
        path, offset = self.source
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
            while done < out.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"{path}: file ended inside a tensor")
                done += n
        return out

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [rows, in] in HF layout (a row slice is only allowed without rope_heads)."""
        from gguf.quants import dequantize

        assert self.rope_heads is None or rows == slice(None)
        # whole tensors are read from the file too: touching even a norm weight through the map can
        # map a large folio of the file's page cache (~1 MiB each on this kernel) into the process
        whole = rows == slice(None) or len(self.shape) == 1
        data = self.copy_data() if whole else self.data[rows]
        values = np.array(dequantize(data, self.qtype), dtype=np.float32)  # a copy: the map is read-only
        w = torch.from_numpy(values.reshape(-1, *self.shape[1:]))
        if self.offset:
            w = w - self.offset
        return w if self.rope_heads is None else unpermute_rope_rows(w, self.rope_heads)


@dataclass(frozen=True, slots=True)
class FloatTensor:
    """A float32 tensor (a Hugging Face folder's weights) behind GGUFTensor's interface."""

    value: torch.Tensor
    qtype: Any = None
    rope_heads: None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.value[rows] if self.value.dim() > 1 else self.value


@dataclass(slots=True, eq=False)  # eq=False: hashable by identity, usable as a cache key
class LoadedModel:
    path: str
    config: ModelConfig
    tensors: dict[str, GGUFTensor | FloatTensor]  # HF names -> the stored tensor
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    fingerprint: str  # stable short hash of the file identity (Redis key prefix)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (eos, end-of-turn, eom)
    _weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to float32 (HF names, layout [out, in]); made on first use and
        kept, so packed-weight modes that never ask for it never hold a float copy."""
        if self._weights is None:
            self._weights = {name: t.dequantize() for name, t in self.tensors.items()}
        return self._weights

    def held_weights(self) -> list[torch.Tensor]:
        """The float32 tensors this model holds now: a folder's weights, and the copies `weights`
        made if anything asked for them (never makes them)."""
        held = [t.value for t in self.tensors.values() if isinstance(t, FloatTensor)]
        return held + (list(self._weights.values()) if self._weights is not None else [])

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (<|im_start|>) are recognised,
        and a BOS leads where the model wants one, once (tokenizer.encode_prompt)."""
        return encode_prompt(self.tokenizer, text, self.add_bos_token, self.bos_token_id).ids

    def encode_with_ends(self, text: str) -> Encoded:
        """`encode`, able to tell where each token ends in `text` (placing cache breakpoints)."""
        return encode_prompt(self.tokenizer, text, self.add_bos_token, self.bos_token_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], options: ChatTemplateOptions = ChatTemplateOptions(),
                    tools: list[dict[str, Any]] | None = None, template: str | None = None) -> str:
        """The chat as the model's template renders it, as `options` asks (tokenizer.ChatTemplateOptions);
        `tools` (transformers' shape) go into the template's `tools` variable, as apply_chat_template passes
        them, or, for a template that never reads it, into the system turn in the generic tool format
        (generic_tools.py). `template` replaces the model's own (--chat-template)."""
        template = template or self.chat_template
        if template is None:
            raise ConfigError(f"the model {self.path!r} has no chat template; send a plain prompt")
        vocab_size = self.tokenizer.get_vocab_size()
        special = {
            name: self.tokenizer.id_to_token(i)
            for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))
            if i is not None and i < vocab_size
        }
        if tools and template_reads_tools(template):
            special["tools"] = tools
        elif tools:
            messages = with_generic_tools(messages, tools)
        text = apply_chat_template(template, messages, options.add_generation_prompt, **options.template_kwargs,
                                   **special)
        return options.rendered(text, messages)


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. Per head, llama.cpp stores rotary pairs interleaved
    (rows 0,1 = pair 0) for its GPT-J RoPE; HF's rotate_half pairs row i with row i + head_dim/2:

        gguf rows (one head): a0 b0 a1 b1 ...   ->   hf rows: a0 a1 ... b0 b1 ...
    """
    half = w.shape[0] // num_heads // 2
    # [heads, half, 2, ...] -> [heads, 2, half, ...]
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
