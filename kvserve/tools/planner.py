"""`kvserve plan`: how much KV cache a model needs, and whether it fits, before the server starts.

All byte counts come from `kvserve.config.kv_bytes_per_page`, the function the engine sizes its page
pool with, and `config.capacity_error_message` is the engine's start-up error text, so the planner
and the engine never disagree (rich and gguf are imported lazily, inside the functions that need them).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache_plan import split_kv_budget, uses_hybrid_kv, window_slots_needed
from kvserve.config import (DEFAULT_KV_CACHE_MEMORY, KV_DTYPE_ALIASES, KV_DTYPES, ConfigError, EngineConfig,
                            ModelConfig, capacity_error_message, format_bytes, format_number, kv_bytes_for_tokens,
                            kv_bytes_per_page, parse_bytes, pool_tokens_for, window_pages_held)
from kvserve.speculative_config import parse_speculative_config

GIB = 1024**3
CONTEXT_STEPS = (2048, 8192, 32768, 131072)
CONCURRENCY_STEPS = (1, 4, 16, 64)
OVERHEAD_FRACTION = 0.10  # share of --memory kept for activations and runtime (vLLM's 0.9 utilization)
WEIGHT_BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model's shape plus what the planner needs beyond ModelConfig: parameter count and, for a
    GGUF file, the bytes its weights take as stored."""

    config: ModelConfig
    num_params: int
    source: str  # "preset", "config.json" or "gguf"
    file_bytes: int | None = None


def _llama(name, vocab, hidden, inter, layers, heads, kv_heads, head_dim, theta, eps, ctx, tied):
    return ModelConfig(name, vocab, hidden, inter, layers, heads, kv_heads, head_dim, theta, eps, ctx, tied)


# Public shapes from each model's config.json. The bool is "q/k/v projections carry a bias" (Qwen2).
PRESETS: dict[str, tuple[ModelConfig, bool]] = {
    "smollm2-135m": (_llama("smollm2-135m", 49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 8192, True), False),
    "llama-3.1-8b": (_llama("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 128, 5e5, 1e-5, 131072, False), False),
    "llama-3.1-70b": (_llama("llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, 128, 5e5, 1e-5, 131072, False), False),
    "qwen2.5-7b": (_llama("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, 1e6, 1e-6, 32768, False), True),
    "mistral-7b": (_llama("mistral-7b", 32768, 4096, 14336, 32, 32, 8, 128, 1e6, 1e-5, 32768, False), False),
}


def count_params(cfg: ModelConfig, qkv_bias: bool = False) -> int:
    """Parameters of a Llama-family decoder: embeddings, per-layer attention + SwiGLU MLP + 2 norms,
    final norm, and an LM head unless tied. Exact for the presets (8,030,261,248 for Llama-3.1-8B)."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = (cfg.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * cfg.hidden_size * cfg.intermediate_size
                 + 2 * cfg.hidden_size + (q_dim + 2 * kv_dim if qkv_bias else 0))
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_layers * per_layer + cfg.hidden_size


def load_model(spec: str) -> ModelShape:
    """A preset name, a model kvserve knows by name (gemma-3-270m), a HF config.json (or a folder
    holding one), or a .gguf file."""
    from kvserve.model.known_models import known_model_path  # torch-free

    key = spec.strip().lower()
    if key in PRESETS:
        cfg, bias = PRESETS[key]
        return ModelShape(cfg, count_params(cfg, bias), "preset")
    path = Path(known_model_path(spec) or spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path)
    if path.suffix == ".json" and path.is_file():
        return _load_hf_config(path)
    raise ConfigError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a readable "
                      "config.json or .gguf file")


def _load_hf_config(path: Path) -> ModelShape:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    raw = raw.get("text_config", raw)  # multimodal configs nest the decoder
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        cfg = ModelConfig(
            name=str(raw.get("_name_or_path") or path.parent.name or path.stem),
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(raw.get("rope_theta", 10000.0)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise ConfigError(f"{path} has no {exc.args[0]!r}; is it a decoder model's config.json?") from None
    bias = bool(raw.get("attention_bias", raw.get("model_type") == "qwen2"))
    return ModelShape(cfg, count_params(cfg, bias), "config.json")


def _load_gguf(path: Path) -> ModelShape:
    from kvserve.model.gguf_config import read_gguf_config  # torch-free, shared with the loader

    cfg, num_params = read_gguf_config(str(path), supported_only=False)
    return ModelShape(cfg, num_params, "gguf", file_bytes=path.stat().st_size)


def kv_cache_bytes(cfg: ModelConfig, kv_dtype: str, context: int, concurrency: int, page_size: int = 16) -> int:
    """Bytes the engine holds for `concurrency` requests of `context` tokens: whole pages each, and in
    sliding-window layers only the window's pages (the hybrid allocator, on by default)."""
    hybrid = uses_hybrid_kv(EngineConfig(page_size=page_size), cfg)
    return kv_bytes_for_tokens(cfg, KV_DTYPES[kv_dtype], context, page_size, hybrid) * concurrency


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset (" + ", ".join(PRESETS) + "), config.json or .gguf")
    parser.add_argument("--context", default=None, help="tokens per request, e.g. 32768 or 32k (default: model max)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests at full context at once (default 1)")
    parser.add_argument("--kv-cache-dtype", default="fp16", help="one or a comma list of " + ", ".join(KV_DTYPES))
    parser.add_argument("--memory", default=None, help="accelerator memory for weights + KV, e.g. 24GiB")
    parser.add_argument("--kv-cache-memory", default=None, help="KV budget as the engine flag (overrides --memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=1 - OVERHEAD_FRACTION,
                        help="the share of --memory the process may use, as the engine's flag on CUDA (default "
                             "0.9; the engine measures what the CUDA context and a step take at start-up)")
    parser.add_argument("--weights-dtype", default=None, choices=sorted(WEIGHT_BYTES_PER_PARAM),
                        help="weights at this dtype (default fp16; a .gguf counts its file size)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="as the engine flag: a draft model's pages are counted beside the model's, e.g. "
                             "'{\"method\": \"draft_model\", \"model\": \"draft.gguf\", \"num_speculative_tokens\": 4}'")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def parse_tokens(value: str | int) -> int:
    """'32768', '32k', '128K', '131,072' -> tokens (k = 1024, as context lengths are quoted)."""
    match = re.fullmatch(r"\s*([0-9][0-9,_]*)\s*([kKmM]?)\s*", str(value))
    if not match:
        raise ConfigError(f"cannot read token count {value!r}; write it like 32768 or 32k")
    scale = {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
    return int(match.group(1).replace(",", "").replace("_", "")) * scale


def _kv_dtypes(value: str) -> list[str]:
    names = list(KV_DTYPES) if value.strip() == "all" else [KV_DTYPE_ALIASES.get(n.strip(), n.strip())
                                                            for n in value.split(",") if n.strip()]
    for name in names:
        if name not in KV_DTYPES:
            raise ConfigError(f"unknown --kv-cache-dtype {name!r}; choose from {', '.join(KV_DTYPES)} or all")
    return names or ["fp16"]


def run_plan(args: argparse.Namespace) -> dict:
    """Everything `kvserve plan` reports, as a JSON-ready dict with stable keys."""
    shape = load_model(args.model)
    cfg, page_size = shape.config, args.page_size
    EngineConfig(page_size=page_size)  # the engine's own page-size validation and message
    model_max = cfg.max_position_embeddings
    context = model_max if args.context is None else parse_tokens(args.context)
    if context < 1 or args.concurrency < 1:
        raise ConfigError(f"--context and --concurrency must be at least 1, got {context} and {args.concurrency}")

    def page_bytes(name: str) -> int:
        return kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, KV_DTYPES[name])

    spec = parse_speculative_config(getattr(args, "speculative_config", None))
    draft = load_model(spec.model) if spec is not None and spec.method == "draft_model" else None

    def draft_page(name: str) -> int:
        """A draft model's page: every layer (no window pool), as many pages as the model's pool."""
        d = draft.config if draft else None
        return kv_bytes_per_page(d.num_layers, d.num_kv_heads, d.head_dim, page_size, KV_DTYPES[name]) if d else 0

    def kv_bytes(name: str, tokens: int, concurrency: int) -> int:
        return (kv_cache_bytes(cfg, name, tokens, concurrency, page_size)
                + concurrency * -(-tokens // page_size) * draft_page(name))

    if shape.file_bytes is not None and args.weights_dtype is None:
        weights_dtype, weights_bytes = "as stored", shape.file_bytes
    else:
        weights_dtype = args.weights_dtype or "fp16"
        weights_bytes = int(shape.num_params * WEIGHT_BYTES_PER_PARAM[weights_dtype])
    if draft is not None:  # the draft's weights sit beside the model's
        weights_bytes += draft.file_bytes if draft.file_bytes is not None and args.weights_dtype is None \
            else int(draft.num_params * WEIGHT_BYTES_PER_PARAM[args.weights_dtype or "fp16"])

    memory = None
    if args.memory is not None:
        budget = parse_bytes(args.memory)
        utilization = getattr(args, "gpu_memory_utilization", 1 - OVERHEAD_FRACTION)
        if not 0.0 < utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        overhead = int(budget * (1 - utilization))
        memory = {"budget_bytes": budget, "weights_bytes": weights_bytes, "overhead_fraction": 1 - utilization,
                  "overhead_bytes": overhead, "kv_budget_bytes": max(0, budget - overhead - weights_bytes),
                  "weights_fit": weights_bytes + overhead <= budget}
    if args.kv_cache_memory is not None:
        kv_budget, kv_source = parse_bytes(args.kv_cache_memory), "--kv-cache-memory"
    elif memory is not None:
        kv_budget, kv_source = memory["kv_budget_bytes"], "--memory"
    else:
        kv_budget, kv_source = parse_bytes(DEFAULT_KV_CACHE_MEMORY), "engine default --kv-cache-memory"

    contexts = sorted({c for c in CONTEXT_STEPS if c <= model_max} | {model_max, context})
    concurrencies = sorted(set(CONCURRENCY_STEPS) | {args.concurrency})
    fp16_token = page_bytes("fp16") / page_size
    mha_token = fp16_token * cfg.num_heads / cfg.num_kv_heads
    defaults = EngineConfig(page_size=page_size)
    hybrid = uses_hybrid_kv(defaults, cfg)
    wanted_slots = window_slots_needed(defaults, cfg.sliding_window) if hybrid else 0
    dtypes = []
    for name in _kv_dtypes(args.kv_cache_dtype):
        per_page = page_bytes(name) + draft_page(name)
        num_pages, num_slots, main_page = split_kv_budget(kv_budget, cfg, page_size, KV_DTYPES[name], wanted_slots,
                                                          draft_page(name))
        pool_tokens = pool_tokens_for(num_pages * main_page, main_page, page_size)
        usable_pages = pool_tokens // page_size
        pages_per_request = math.ceil(context / page_size)
        needed = kv_bytes(name, context, args.concurrency)
        weights_ok = memory is None or memory["weights_fit"]
        window_ok = not hybrid or args.concurrency * window_pages_held(context, cfg.sliding_window, page_size) \
            < num_slots
        dtypes.append({
            "kv_dtype": name, "bytes_per_token": per_page / page_size, "bytes_per_page": per_page,
            "draft_bytes_per_token": draft_page(name) / page_size,
            "table": [{"context": c, "bytes": [kv_bytes(name, c, n) for n in concurrencies],
                       "gib": [kv_bytes(name, c, n) / GIB for n in concurrencies]}
                      for c in contexts],
            "request_bytes": kv_bytes(name, context, 1),
            "needed_bytes": needed, "needed_gib": needed / GIB, "pool_tokens": pool_tokens,
            "window_pool_pages": max(0, num_slots - 1),
            "room_bytes": usable_pages * (main_page + draft_page(name))
            + max(0, num_slots - 1) * (page_bytes(name) - main_page),
            "fits": weights_ok and window_ok and pages_per_request * args.concurrency <= usable_pages,
            "max_context_at_concurrency": min(usable_pages // args.concurrency * page_size, model_max),
            "max_concurrency_at_context": usable_pages // pages_per_request,
            "startup_ok": context <= pool_tokens,
            "startup_error": None if context <= pool_tokens else
            capacity_error_message(context, pool_tokens, kv_budget, per_page / page_size, draft_page(name) / page_size),
        })
    return {
        "model": {"name": cfg.name, "source": shape.source, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                  "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size,
                  "max_position_embeddings": model_max, "num_params": shape.num_params,
                  "weights_dtype": weights_dtype, "weights_bytes": weights_bytes,
                  "sliding_window": cfg.sliding_window, "num_window_layers": cfg.num_window_layers},
        "hybrid_kv": hybrid,
        "draft": None if draft is None else {
            "name": draft.config.name, "source": draft.source, "num_layers": draft.config.num_layers,
            "num_kv_heads": draft.config.num_kv_heads, "head_dim": draft.config.head_dim,
            "bytes_per_token": {name: draft_page(name) / page_size for name in KV_DTYPES}},
        "page_size": page_size, "context": context, "concurrency": args.concurrency,
        "context_beyond_model_max": context > model_max,
        "bytes_per_token": {name: page_bytes(name) / page_size for name in KV_DTYPES},
        "gqa": {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                "ratio": cfg.num_heads / cfg.num_kv_heads, "fp16_bytes_per_token": fp16_token,
                "mha_fp16_bytes_per_token": mha_token, "saved_fraction": 1 - fp16_token / mha_token,
                "note": _gqa_note(cfg, fp16_token, mha_token)},
        "contexts": contexts, "concurrencies": concurrencies,
        "memory": memory, "kv_budget_bytes": kv_budget, "kv_budget_source": kv_source,
        "dtypes": dtypes,
    }


def _gqa_note(cfg: ModelConfig, fp16_token: float, mha_token: float) -> str:
    if cfg.num_kv_heads == cfg.num_heads:
        return f"MHA: each of the {cfg.num_heads} query heads keeps its own K/V head, so there is no GQA saving."
    ratio = cfg.num_heads / cfg.num_kv_heads
    return (f"GQA: {cfg.num_heads} query heads share {cfg.num_kv_heads} KV heads ({ratio:g}:1), so fp16 KV is "
            f"{format_number(fp16_token)} bytes/token instead of {format_number(mha_token)} with full multi-head attention "
            f"({1 - fp16_token / mha_token:.0%} less).")


def _fmt_gib(gib: float) -> str:
    text = f"{gib:,.2f}" if gib >= 0.01 else f"{gib:.4f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def render_plan(result: dict, console) -> None:
    """Print the plan as rich tables and one-line verdicts."""
    from rich.markup import escape
    from rich.table import Table

    m = result["model"]
    console.print(f"[bold]{m['name']}[/] ({m['source']}): {m['num_layers']} layers, {m['num_heads']} heads, "
                  f"{m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, max context "
                  f"{m['max_position_embeddings']:,}, {m['num_params'] / 1e9:.2f}B params, weights "
                  f"{format_bytes(m['weights_bytes'])} ({m['weights_dtype']})")
    console.print(result["gqa"]["note"])
    if result["hybrid_kv"]:
        console.print(f"Sliding window of {m['sliding_window']:,} tokens in {m['num_window_layers']} of "
                      f"{m['num_layers']} layers: they keep only the window's pages (the hybrid allocator), "
                      "and the tables below count them that way")
    if (draft := result["draft"]) is not None:
        console.print(f"Draft model {draft['name']} ({draft['source']}): "
                      f"{format_number(draft['bytes_per_token']['fp16'])} "
                      "bytes/token at fp16, in pages of its own (as many as the model's): the per-dtype "
                      "tables and verdicts below count both, and its weights beside the model's")
    per_token = Table(title="KV bytes per token")
    for col in ("kv dtype", "bytes/token", f"bytes/page of {result['page_size']}", "vs fp16"):
        per_token.add_column(col, justify="right")
    for name, value in result["bytes_per_token"].items():
        per_token.add_row(name, format_number(value), f"{value * result['page_size']:,.0f}",
                          f"{value / result['bytes_per_token']['fp16']:.3f}x")
    console.print(per_token)
    console.print("(int8/int4 pages carry one float32 scale per KV head per layer for K and V; "
                  "bytes/token spreads them over the page)")
    pool_note = f"{format_bytes(result['kv_budget_bytes'])} KV budget from {result['kv_budget_source']}"
    console.print(f"KV cache for context x concurrency, in GiB; green fits the {pool_note}, red does not")
    for d in result["dtypes"]:
        table = Table(title=f"{d['kv_dtype']}: {format_number(d['bytes_per_token'])} bytes/token")
        table.add_column("context", justify="right")
        for n in result["concurrencies"]:
            table.add_column(f"x{n}", justify="right")
        room = d["room_bytes"]  # bytes of usable pages
        if result["memory"] is not None and not result["memory"]["weights_fit"]:
            room = -1
        for row in d["table"]:
            cells = [f"[{'green' if b <= room else 'red'}]{_fmt_gib(g)}[/]" for b, g in zip(row["bytes"], row["gib"])]
            table.add_row(f"{row['context']:,}", *cells)
        console.print(table)
    if (mem := result["memory"]) is not None:
        console.print(f"--memory {format_bytes(mem['budget_bytes'])}: weights {format_bytes(mem['weights_bytes'])} + "
                      f"{mem['overhead_fraction']:.0%} kept for activations and runtime "
                      f"({format_bytes(mem['overhead_bytes'])}) leaves {format_bytes(mem['kv_budget_bytes'])} for KV"
                      + ("" if mem["weights_fit"] else " [red](the weights alone do not fit)[/]"))
    if result["context_beyond_model_max"]:
        console.print(f"[yellow]--context {result['context']:,} is beyond the model's "
                      f"{m['max_position_embeddings']:,} positions[/]")
    ctx, conc = result["context"], result["concurrency"]
    for d in result["dtypes"]:
        verdict = "[green]fits[/]" if d["fits"] else "[red]does not fit[/]"
        console.print(f"{d['kv_dtype']}: {conc} x {ctx:,} tokens need {_fmt_gib(d['needed_gib'])} GiB: {verdict} "
                      f"in the {pool_note} ({d['pool_tokens']:,} tokens); largest context at concurrency {conc}: "
                      f"{d['max_context_at_concurrency']:,}; largest concurrency at {ctx:,}: "
                      f"{d['max_concurrency_at_context']:,}")
        console.print(f"  engine start-up with --max-model-len {ctx:,}: "
                      + ("[green]ok[/]" if d["startup_ok"] else f"[red]{escape(d['startup_error'])}[/]"))


def main_plan(args: argparse.Namespace) -> int:
    """`kvserve plan`. A ConfigError propagates for the CLI to print as one line."""
    result = run_plan(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        render_plan(result, Console())
        print(_memory_promise(result, args).line())
    return 0


def _memory_promise(result: dict, args: argparse.Namespace):
    """The sum `kvserve serve` logs at start-up, for this plan's weights and KV budget."""
    from kvserve.memory_promise import memory_promise

    swap = getattr(args, "swap_space", None) or EngineConfig().swap_space
    disk = getattr(args, "kv_disk_bytes", None)
    return memory_promise(result["model"]["weights_bytes"], result["kv_budget_bytes"],
                          parse_bytes(swap), parse_bytes(disk) if disk else 0)
