"""Frozen configuration of the model, the KV cache and the engine, and the KV byte arithmetic.

`KVDtype` is the single source of bytes-per-element and scale overhead: the engine's page count and
`kvserve plan` both call `kv_bytes_per_page`, so they can never disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ConfigError  # noqa: F401  (re-exported: most modules import it from here)
from kvserve.units import format_bytes, format_number, parse_bytes  # noqa: F401  (re-exported)
from kvserve.speculative_config import SpeculativeConfig, parse_speculative_config

# public-domain text shipped with the package: `kvserve eval-kv` and the fp8 calibration pass read it
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclass(frozen=True, slots=True)
class KVDtype:
    """How one KV element is stored. `scale_bytes_per_page_head` counts the scales kept per page,
    per KV head, per layer, for K and V each (int8/int4 use one float32 scale per page per head)."""

    name: str
    bits: int
    scale_bytes_per_page_head: int = 0
    is_float: bool = True

    @property
    def bytes_per_element(self) -> float:
        return self.bits / 8


KV_DTYPES: dict[str, KVDtype] = {
    "fp32": KVDtype("fp32", 32),
    "fp16": KVDtype("fp16", 16),
    "bf16": KVDtype("bf16", 16),
    "fp8_e4m3": KVDtype("fp8_e4m3", 8),
    "fp8_e5m2": KVDtype("fp8_e5m2", 8),
    "int8": KVDtype("int8", 8, scale_bytes_per_page_head=4, is_float=False),
    "int4": KVDtype("int4", 4, scale_bytes_per_page_head=4, is_float=False),
}
# vLLM's spellings, with vLLM's meanings: its `fp8` is fp8_e4m3 (on CUDA; ROCm's fnuz aside), `half` is float16
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MODEL_DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# Weight modes (kvserve/model/linear.py) and the KV dtype `--kv-cache-dtype auto` gives each: the
# packed-weight modes int4 and int8 compute in bfloat16; native (the GGUF's own blocks on kvserve's
# kernels) computes in float32 over bf16 pages. float32 is the exact path.
MODEL_DTYPE_TO_KV = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int4": "bf16", "int8": "bf16",
                     "native": "bf16"}
MODEL_DTYPES = tuple(MODEL_DTYPE_TO_KV)
# `--dtype auto`: the fastest mode whose perplexity drift vs float32 is under 1% (README, "Weight
# formats"). On CPU that is `native` wherever kvserve's kernels are built and enabled; without them,
# torch's packed int4 (also on AVX2-only hosts: `python -m kvserve.tools.matmul_bench --modes
# int4,bfloat16` on Zen 3, one thread, gave a decode step's GEMVs 36.0 ms against 39.7 ms and a
# 512-row chunk 13.1 s against 12.9 s); other devices get bfloat16.
AUTO_DTYPE_NATIVE = "native"
AUTO_DTYPE_TORCH_CPU = "int4"
AUTO_DTYPE_OTHER = "bfloat16"


def resolve_model_dtype(dtype: str, device: str) -> str:
    """`auto` -> the weight mode for `device`; other names are checked and returned."""
    dtype = MODEL_DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        if device.split(":")[0] != "cpu":
            return AUTO_DTYPE_OTHER
        from kvserve import kernels

        return AUTO_DTYPE_NATIVE if kernels.available() else AUTO_DTYPE_TORCH_CPU
    if dtype not in MODEL_DTYPES:
        raise ConfigError(f"--dtype must be one of auto, {', '.join(MODEL_DTYPES)}, got {dtype!r}")
    return dtype


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> KVDtype:
    """`auto` means the model's own dtype."""
    name = MODEL_DTYPE_TO_KV[model_dtype] if kv_cache_dtype == "auto" else KV_DTYPE_ALIASES.get(kv_cache_dtype,
                                                                                                kv_cache_dtype)
    if name not in KV_DTYPES:
        raise ConfigError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of auto, {', '.join(KV_DTYPES)}"
        )
    return KV_DTYPES[name]


def kv_bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: KVDtype
) -> int:
    """Bytes of one page across all layers: K and V elements plus their scales."""
    elements = 2 * num_layers * page_size * num_kv_heads * head_dim
    scales = 2 * num_layers * num_kv_heads * kv_dtype.scale_bytes_per_page_head
    return int(elements * kv_dtype.bits) // 8 + scales


class PrefixCachePolicy(str, enum.Enum):
    RADIX = "radix"
    HASH = "hash"
    OFF = "off"


class PreemptionMode(str, enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or a HF config.json."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    # Options beyond plain Llama (Qwen3, Llama 3.x, Gemma 3); the defaults are Llama's behaviour.
    architecture: str = "llama"
    rope_freq_factors: tuple[float, ...] | None = None  # divide RoPE inverse frequencies (llama3, linear)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 3)
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + w): 1.0 for Gemma
    hidden_act: str = "silu"  # MLP gate activation: "silu" or "gelu_tanh"
    embedding_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # window of the sliding layers: query p sees keys > p - window
    sliding_layers: tuple[bool, ...] = ()  # per layer, True = sliding window; empty: all global
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma: 10,000)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer`, None for full (global) attention."""
        if self.sliding_window is None or not self.sliding_layers or not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def num_window_layers(self) -> int:
        """Layers with a sliding window (their KV can live in the window pool)."""
        return sum(self.layer_window(i) is not None for i in range(self.num_layers))


def first_window_page(num_tokens: int, window: int, page_size: int) -> int:
    """First page a sliding-window layer's query at position `num_tokens` can see (keys at
    positions > num_tokens - window); the pages before it are released."""
    return max(0, num_tokens - window + 1) // page_size


def window_pages_held(num_tokens: int, window: int, page_size: int) -> int:
    """Pages a sliding-window layer keeps for a sequence of `num_tokens` computed tokens: those its
    next query (at position num_tokens) can still see."""
    return max(0, -(-num_tokens // page_size) - first_window_page(num_tokens, window, page_size))


def kv_bytes_for_tokens(model: ModelConfig, kv_dtype: KVDtype, num_tokens: int, page_size: int,
                        hybrid: bool = True) -> int:
    """KV bytes one sequence of `num_tokens` holds: whole pages in full-attention layers, and with the
    hybrid allocator only the window's pages in sliding-window layers (`kvserve plan` and
    `llm.stats()["kv_bytes_used"]` both count this way)."""
    layer_page = kv_bytes_per_page(1, model.num_kv_heads, model.head_dim, page_size, kv_dtype)
    windowed = model.num_window_layers if hybrid else 0
    pages = -(-num_tokens // page_size)
    held = window_pages_held(num_tokens, model.sliding_window, page_size) if windowed else 0
    return layer_page * ((model.num_layers - windowed) * pages + windowed * held)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The page pool as the engine sizes it; the KV dtype is resolved here once."""

    page_size: int
    num_pages: int  # including the reserved null page 0
    kv_dtype: KVDtype
    prefix_cache: PrefixCachePolicy = PrefixCachePolicy.RADIX
    max_leased_fraction: float = 0.5  # of the pool's pages, at most, held by cache leases
    tenant_kv_share: str = "off"  # "fair": under pressure, evict from tenants over an equal share first
    # Hybrid allocator (sliding-window models): pages of the window pool, 0 = every layer in one pool
    num_window_slots: int = 0
    sliding_window: int | None = None

    @property
    def partial_page_hits(self) -> bool:
        """False for KV dtypes with per-page scales (int8/int4): a page's scale depends on all its
        tokens, so a copied partial page would carry another request's tokens into its numbers."""
        return not self.kv_dtype.scale_bytes_per_page_head


DEFAULT_KV_CACHE_MEMORY = "1GiB"  # the page pool on the CPU when --kv-cache-memory is not given


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """User-facing engine knobs, validated on construction."""

    model: str | None = None
    page_size: int = 16
    prefix_cache: str = "radix"
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str | int | None = None  # the page pool's bytes; None: DEFAULT_KV_CACHE_MEMORY on the
    # CPU, --gpu-memory-utilization's share on CUDA
    gpu_memory_utilization: float = 0.9  # CUDA: the fraction of the card this process may use (vLLM's)
    enforce_eager: bool = False  # CUDA: no decode graphs (vLLM's --enforce-eager)
    grammar_compile_timeout: float = 10.0  # seconds a server request's constraint may take to compile
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    swap_space: str | int = "2GiB"
    device: str = "cpu"
    dtype: str = "auto"  # resolved on construction: config.dtype is always a concrete mode
    redis_url: str | None = None
    calculate_kv_scales: bool = False  # fp8 KV: per-tensor scale from a start-up calibration pass
    role: str = "both"  # both | prefill (compute prompts, publish their pages) | decode
    min_cacheable_tokens: int = 1024  # cache breakpoints on shorter prefixes get no lease
    max_leased_fraction: float = 0.5
    tenant_kv_share: str = "off"  # fair | off
    lease_ttl_scale: float = 1.0  # multiplies lease TTLs (tests scale 5 minutes down to seconds)
    tool_call_kv_ttl: float = 30.0  # seconds an answer that ends in a tool call keeps its KV leased; 0: off
    chat_template: str | None = None  # a Jinja file or string that replaces the model's own template
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557: KV events, vLLM's schema
    kv_events_topic: str = ""  # vLLM's topic; {pod_ip} {port} {model} filled in by `kvserve serve`
    kv_events_encoding: str = "array"  # array (vLLM <= 0.11, Dynamo, llm-d) | map (current vLLM)
    kv_events_mode: str = "bind"  # bind | connect (the PUB socket; replay always binds)
    kv_events_replay_endpoint: str | None = None  # None: events port + 1 when binding, none when connecting; "off"
    kv_events_token_ids: bool = True  # False: BlockStored carries no token ids
    kv_events_allow_remote: bool = False  # bind a non-loopback address without CURVE
    kv_events_allow_plaintext: bool = False  # connect mode: a non-loopback address without CURVE
    kv_events_curve_secret_file: str | None = None  # CURVE secret key (Z85): subscribers need its public key
    kv_events_curve_clients_file: str | None = None  # subscriber public keys let in (ZAP); None: any with the server key
    kv_disk_path: str | None = None  # disk tier directory (pages survive restarts)
    kv_disk_bytes: str | int = "10GiB"
    kv_pin_bytes: str | int | None = None  # 24h retention pins in the disk/Redis tier; None: half the disk tier
    kv_pin_tenant_bytes: str | int | None = None  # ... per tenant; None: a quarter of kv_pin_bytes
    # Sliding-window layers keep only their window's pages (vLLM's hybrid KV cache manager). Off
    # when tiers below the pool are asked for (swap, Redis, disk), whose pages carry every layer.
    disable_hybrid_kv_cache_manager: bool = False
    threads: int | None = None  # torch threads (llama.cpp's -t); None: $OMP_NUM_THREADS, else every usable core
    # vLLM's --speculative-config (a dict, its JSON, or a SpeculativeConfig); None: off
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if not (1 <= self.page_size <= 256) or self.page_size & (self.page_size - 1):
            raise ConfigError(f"--page-size must be a power of two from 1 to 256, got {self.page_size}")
        if self.prefix_cache not in {p.value for p in PrefixCachePolicy}:
            raise ConfigError(f"--prefix-cache must be radix, hash or off, got {self.prefix_cache!r}")
        if self.preemption_mode not in {p.value for p in PreemptionMode}:
            raise ConfigError(
                f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}"
            )
        object.__setattr__(self, "dtype", resolve_model_dtype(self.dtype, self.device))
        resolve_kv_dtype(self.kv_cache_dtype, self.dtype)
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if not self.grammar_compile_timeout > 0:
            raise ConfigError(f"--grammar-compile-timeout must be positive, got {self.grammar_compile_timeout}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        parse_bytes(self.swap_space)
        for size in (self.kv_disk_bytes, self.kv_pin_bytes, self.kv_pin_tenant_bytes):
            parse_bytes(size) if size is not None else None
        if self.kv_disk_path and self.prefix_cache == PrefixCachePolicy.OFF.value:
            raise ConfigError("--kv-disk-path keeps prefix-cache pages; use --prefix-cache radix or hash")
        if self.kv_events_endpoint and not self.kv_events_endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--kv-events-endpoint must look like tcp://HOST:PORT, "
                              f"got {self.kv_events_endpoint!r}")
        if self.kv_events_encoding not in ("array", "map"):
            raise ConfigError(f"--kv-events-encoding must be array or map, got {self.kv_events_encoding!r}")
        if self.kv_events_mode not in ("bind", "connect"):
            raise ConfigError(f"--kv-events-mode must be bind or connect, got {self.kv_events_mode!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        if not 0.0 <= self.max_leased_fraction <= 0.9:
            raise ConfigError(f"--max-leased-fraction must be in [0, 0.9], got {self.max_leased_fraction}")
        if self.tenant_kv_share not in ("fair", "off"):
            raise ConfigError(f"--tenant-kv-share must be fair or off, got {self.tenant_kv_share!r}")
        if not 0.0 <= self.tool_call_kv_ttl <= 3600.0:
            raise ConfigError(f"--tool-call-kv-ttl must be in [0, 3600] seconds, got {self.tool_call_kv_ttl}")
        if self.min_cacheable_tokens < 0 or self.lease_ttl_scale <= 0:
            raise ConfigError("--min-cacheable-tokens must be >= 0 and --lease-ttl-scale > 0")
        if self.role not in ("both", "prefill", "decode"):
            raise ConfigError(f"--role must be both, prefill or decode, got {self.role!r}")
        if self.role != "both" and not self.redis_url:
            raise ConfigError(f"--role {self.role} shares pages through Redis; add --redis-url")
        if self.redis_url:
            if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"--redis-url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
            if self.prefix_cache == PrefixCachePolicy.OFF.value:
                raise ConfigError("--redis-url shares prefix-cache pages; use --prefix-cache radix "
                                  "or hash with it")


# -- pool capacity: the engine's start-up check and `kvserve plan` share these -----------------------

def pool_tokens_for(kv_cache_memory_bytes: int, bytes_per_page: int, page_size: int) -> int:
    """Tokens the page pool holds: whole pages in the budget, less the reserved null page 0."""
    return max(0, kv_cache_memory_bytes // bytes_per_page - 1) * page_size


def capacity_error_message(max_model_len: int, pool_tokens: int, kv_cache_memory_bytes: int,
                           bytes_per_token: float, draft_bytes_per_token: float = 0,
                           budget: str | None = None, flag: str = "--kv-cache-memory") -> str:
    """The engine's one-line start-up error when one sequence of max_model_len tokens cannot fit
    (with a draft model, bytes_per_token counts its KV too). `budget`: where the pool's bytes came
    from, when not `flag` itself (a GPU's utilization share); `flag`: the one to raise."""
    budget = budget or f"{flag} {format_bytes(kv_cache_memory_bytes)}"
    draft = (f" ({format_number(bytes_per_token - draft_bytes_per_token)} target + "
             f"{format_number(draft_bytes_per_token)} draft model)") if draft_bytes_per_token else ""
    return (f"max_model_len {max_model_len:,} tokens does not fit in the KV cache: {budget} holds "
            f"{pool_tokens:,} tokens at {format_number(bytes_per_token)} bytes per token{draft}, and "
            f"{max_model_len:,} tokens need about {format_bytes(max_model_len * bytes_per_token)}; raise "
            f"{flag} or lower --max-model-len to {pool_tokens:,} or less")
