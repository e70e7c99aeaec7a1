"""The engine flags shared by `kvserve generate`, `serve` and `bench` (DESIGN.md §4), and their
mapping onto EngineConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

from kvserve.config import MODEL_DTYPE_ALIASES, MODEL_DTYPES, EngineConfig
from kvserve.vllm_flags import add_vllm_flags, swap_space

ENGINE_DEFAULTS = EngineConfig()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by serve, generate and bench (DESIGN.md §4)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="a .gguf path (default: bundled SmolLM2-135M-Instruct)")
    group.add_argument("--page-size", type=int, default=ENGINE_DEFAULTS.page_size)
    group.add_argument("--prefix-cache", default=ENGINE_DEFAULTS.prefix_cache, choices=["radix", "hash", "off"])
    group.add_argument("--kv-cache-dtype", default=ENGINE_DEFAULTS.kv_cache_dtype)
    group.add_argument("--kv-cache-memory", default=None,
                       help="the KV page pool's bytes, e.g. 4GiB (default: 1GiB on the CPU; on CUDA the "
                            "share --gpu-memory-utilization leaves)")
    group.add_argument("--gpu-memory-utilization", type=float, default=ENGINE_DEFAULTS.gpu_memory_utilization,
                       help="CUDA: the fraction of the card's memory this process may use (vLLM's flag); "
                            "the KV pool gets what the weights and a profiled step leave of it")
    group.add_argument("--grammar-compile-timeout", type=float, default=ENGINE_DEFAULTS.grammar_compile_timeout,
                       metavar="SECONDS",
                       help="a request's structured-outputs constraint (JSON schema, grammar, forced tool "
                            "call) compiles on a worker thread; one that takes longer gets a 400, and so "
                            "do its retries (default 10)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
    group.add_argument("--max-num-seqs", type=int, default=ENGINE_DEFAULTS.max_num_seqs)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS.max_num_batched_tokens)
    group.add_argument("--preemption-mode", default=ENGINE_DEFAULTS.preemption_mode, choices=["recompute", "swap"])
    group.add_argument("--swap-space", default=ENGINE_DEFAULTS.swap_space, type=swap_space,
                       help="the host tier (swapped and offloaded pages); a number without a unit is "
                            "GiB, as in vLLM (--swap-space 4 = 4 GiB); 0 turns it off")
    group.add_argument("--device", default=ENGINE_DEFAULTS.device)
    group.add_argument("--threads", "-t", type=int, default=None,
                       help="torch and kernel threads (default: $OMP_NUM_THREADS, else every usable core, "
                            "`serve` included, as llama-server)")
    group.add_argument("--dtype", default="auto", choices=["auto", *MODEL_DTYPES, *MODEL_DTYPE_ALIASES],
                       help="weights and compute: float32 (exact), bfloat16, float16, int4 / int8 (the "
                            "GGUF's packed weights on torch's CPU kernels, bfloat16 activations); auto "
                            "(default): int4 on CPU, bfloat16 elsewhere")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: set the per-tensor scale from a calibration pass at start-up "
                            "(default: scale 1.0)")
    group.add_argument("--redis-url", default=None,
                       help="share KV pages with other instances through Redis, e.g. "
                            "redis://127.0.0.1:6379/0 (0.25 s timeouts; ?socket_timeout=0.1 to change)")
    group.add_argument("--kv-disk-path", default=None, metavar="DIR",
                       help="disk tier: committed pages are written here by hash and found again "
                            "after a restart")
    group.add_argument("--kv-disk-bytes", default=ENGINE_DEFAULTS.kv_disk_bytes,
                       help="byte budget of the disk tier (LRU within it)")
    group.add_argument("--kv-pin-bytes", default=None,
                       help="prompt_cache_retention 24h: bytes of pages pinned for 24 h in the disk and "
                            "Redis tiers (default: half of --kv-disk-bytes; 1GiB with Redis only)")
    group.add_argument("--kv-pin-tenant-bytes", default=None,
                       help="the same per API key (default: a quarter of --kv-pin-bytes); over it the "
                            "response says retention was capped")
    group.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                       help="publish KV events (vLLM's BlockStored/BlockRemoved schema, msgpack over "
                            "ZMQ PUB); replay socket on the next port. Loopback addresses only unless "
                            "--kv-events-allow-remote or a CURVE key is given")
    group.add_argument("--kv-events-topic", default=ENGINE_DEFAULTS.kv_events_topic, metavar="TOPIC",
                       help="the events' ZMQ topic, with {pod_ip} ($POD_IP, else this host's "
                            "address), {port} (the HTTP port) and {model} (the served model name) "
                            "filled in; llm-d: 'kv@{pod_ip}:{port}@{model}'")
    group.add_argument("--kv-events-encoding", default=ENGINE_DEFAULTS.kv_events_encoding,
                       choices=["array", "map"],
                       help="array: vLLM's positional msgpack (Dynamo, llm-d, vLLM <= 0.11); map: "
                            "field-name maps as current vLLM sends")
    group.add_argument("--kv-events-mode", default=ENGINE_DEFAULTS.kv_events_mode,
                       choices=["bind", "connect"],
                       help="bind the events socket (subscribers connect) or connect it to a "
                            "subscriber that binds (an indexer's address); replay always binds")
    group.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT|off",
                       help="where the replay socket binds (default: the events port + 1 in bind "
                            "mode, none in connect mode)")
    group.add_argument("--kv-events-token-ids", default="auto", choices=["on", "off", "auto"],
                       help="off: BlockStored carries no token ids (no prompt text leaves the "
                            "process); only routers matching kvserve's block hashes (kvserve "
                            "router) still route by them, llm-d and Dynamo do not. auto (default): "
                            "off when `kvserve serve` has API keys and the events socket no CURVE "
                            "key (any local user could read every tenant's prompts), else on")
    group.add_argument("--kv-events-allow-remote", action="store_true",
                       help="allow binding the events and replay sockets on a non-loopback address "
                            "without CURVE (anyone who reaches the port reads every tenant's tokens)")
    group.add_argument("--kv-events-allow-plaintext", action="store_true",
                       help="--kv-events-mode connect: allow a non-loopback address without CURVE "
                            "(refused by default: the events would cross the network in plain text)")
    group.add_argument("--kv-events-curve-secret-file", default=None, metavar="FILE",
                       help="a CURVE secret key (Z85, 40 characters; make one with python -c "
                            "'import zmq; print(zmq.curve_keypair()[1].decode())'): the sockets "
                            "encrypt, and only subscribers given its public key connect")
    group.add_argument("--kv-events-curve-clients-file", default=None, metavar="FILE",
                       help="with a CURVE key: only subscribers whose CURVE public key is listed here "
                            "(one per line) get in; without it any subscriber that knows the server's "
                            "public key does")
    group.add_argument("--min-cacheable-tokens", type=int, default=ENGINE_DEFAULTS.min_cacheable_tokens,
                       help="cache breakpoints (cache_control, kv_retention) on shorter prefixes get no lease")
    group.add_argument("--max-leased-fraction", type=float, default=ENGINE_DEFAULTS.max_leased_fraction,
                       help="at most this fraction of the KV pages is held by cache leases")
    group.add_argument("--tool-call-kv-ttl", type=float, default=ENGINE_DEFAULTS.tool_call_kv_ttl,
                       metavar="SECONDS",
                       help="an answer that ends in a tool call keeps its conversation's KV pages leased "
                            "this long, or until the request with the tool's result arrives (0: off); "
                            "counted against --max-leased-fraction")
    group.add_argument("--chat-template", default=None, metavar="FILE|STRING",
                       help="a Jinja chat template (a file, or the template itself) that replaces the "
                            "model's own; tools go where it reads `tools`, else into the system turn in "
                            "the generic tool format")
    group.add_argument("--tenant-kv-share", default=ENGINE_DEFAULTS.tenant_kv_share, choices=["fair", "off"],
                       help="fair: under memory pressure, evict cached pages of tenants (API keys) over "
                            "an equal share first")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="sliding-window models (Gemma 3): keep every page in every layer instead of "
                            "only the window's pages in the windowed layers")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding as vLLM spells it, e.g. '{\"method\": \"ngram\", "
                            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3, \"prompt_lookup_min\": 2}' "
                            "(prompt lookup over the request's own tokens), or '{\"method\": \"draft_model\", "
                            "\"model\": \"draft.gguf\", \"num_speculative_tokens\": 4}' (a smaller model with the "
                            "same tokenizer, its KV counted in --kv-cache-memory); greedy outputs unchanged")
    group.add_argument("--lease-ttl-scale", type=float, default=ENGINE_DEFAULTS.lease_ttl_scale,
                       help=argparse.SUPPRESS)  # tests: 5m/1h TTLs in seconds
    group.add_argument("--kv-tier-secret-file", default=None, metavar="FILE",
                       help="a secret shared by the instances of one Redis tier: keys become keyed "
                            "hashes and every value carries a MAC, so no other writer can plant "
                            "pages (or set $KVSERVE_KV_TIER_SECRET)")
    add_vllm_flags(group)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's fields from the flags (each flag's dest is its field's name; `--model` is
    given apart); also sets the process's tier secret from its file."""
    configure_tier_secret(args)
    kwargs = {name: getattr(args, name) for name in _flag_fields() if hasattr(args, name)}
    # "auto" is resolved by `kvserve serve`, which knows its API keys (launch.event_token_ids);
    # without a server there are no tenants to keep apart
    kwargs["kv_events_token_ids"] = kwargs.get("kv_events_token_ids", "on") != "off"
    return kwargs


def _flag_fields() -> list[str]:
    """The EngineConfig fields add_engine_arguments has a flag for, in flag order."""
    fields_ = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "role"}
    return [a.dest for a in _engine_parser()._actions if a.dest in fields_]


@functools.cache
def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def engine_argv(kwargs: dict) -> list[str]:
    """The flags that give EngineConfig's fields `kwargs` (engine_kwargs' inverse, for starting
    `kvserve serve` in a child process): each value written as its flag parses it (a bare switch,
    on|off, or text); None and False switches left out."""
    actions: dict[str, argparse.Action] = {}
    for action in _engine_parser()._actions:  # a field's first flag (kvserve's own, not vLLM's alias)
        actions.setdefault(action.dest, action)
    argv: list[str] = []
    for key, value in kwargs.items():
        action = actions.get(key)
        if action is None:
            raise ValueError(f"no engine flag sets {key!r}")
        flag = action.option_strings[0]
        if action.choices is not None and list(action.choices)[:2] == ["on", "off"]:
            argv += [flag, "on" if value else "off"]
        elif isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def configure_tier_secret(args: argparse.Namespace) -> None:
    """--kv-tier-secret-file -> the secret every tier of this process signs with (read once here,
    so it never appears on the command line)."""
    from kvserve.cache.tier_auth import read_secret_file, set_process_secret

    path = getattr(args, "kv_tier_secret_file", None)
    if path:
        set_process_secret(read_secret_file(path))
