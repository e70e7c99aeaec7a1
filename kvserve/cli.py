"""The `kvserve` command: subcommands parse their flags here and call into the engine or the tools.
User mistakes end as one line on stderr (`kvserve: error: ...`) and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvserve.config import ConfigError, EngineConfig

ENGINE_DEFAULTS = EngineConfig()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by serve, generate and bench (DESIGN.md §4)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="a .gguf path (default: bundled SmolLM2-135M-Instruct)")
    group.add_argument("--page-size", type=int, default=ENGINE_DEFAULTS.page_size)
    group.add_argument("--prefix-cache", default=ENGINE_DEFAULTS.prefix_cache, choices=["radix", "hash", "off"])
    group.add_argument("--kv-cache-dtype", default=ENGINE_DEFAULTS.kv_cache_dtype)
    group.add_argument("--kv-cache-memory", default=ENGINE_DEFAULTS.kv_cache_memory)
    group.add_argument("--max-num-seqs", type=int, default=ENGINE_DEFAULTS.max_num_seqs)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS.max_num_batched_tokens)
    group.add_argument("--preemption-mode", default=ENGINE_DEFAULTS.preemption_mode, choices=["recompute", "swap"])
    group.add_argument("--swap-space", default=ENGINE_DEFAULTS.swap_space)
    group.add_argument("--device", default=ENGINE_DEFAULTS.device)
    group.add_argument("--dtype", default=ENGINE_DEFAULTS.dtype, choices=["float32", "bfloat16", "float16"])
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: set the per-tensor scale from a calibration pass at start-up "
                            "(default: scale 1.0)")
    group.add_argument("--redis-url", default=None,
                       help="share KV pages with other instances through Redis, e.g. "
                            "redis://127.0.0.1:6379/0 (0.25 s timeouts; ?socket_timeout=0.1 to change)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(page_size=args.page_size, prefix_cache=args.prefix_cache,
                kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
                preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                device=args.device, dtype=args.dtype, redis_url=getattr(args, "redis_url", None),
                calculate_kv_scales=getattr(args, "calculate_kv_scales", False))


def main_generate(args: argparse.Namespace) -> int:
    from kvserve.engine import LLM
    from kvserve.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(model=args.model, **engine_kwargs(args))
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    llm.engine.close()  # with --redis-url: the new pages reach Redis before the process ends
    print(output.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM inference server built around its KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_arguments(gen)
    gen.set_defaults(func=main_generate)

    _add_tools(sub)
    return parser


# subcommand -> (module, help); each module has add_<x>_arguments(parser) and main_<x>(args)
_TOOLS = {
    "plan": ("kvserve.tools.planner", "plan", "KV cache capacity planning for a model"),
    "cost": ("kvserve.tools.pricing", "cost", "provider prompt-cache cost with and without caching"),
    "simulate": ("kvserve.tools.simulate", "simulate",
                 "replay a trace through the prefix cache: hit rates and diagnosis"),
    "serve": ("kvserve.server", "serve", "the OpenAI-compatible HTTP server, /metrics and /dashboard"),
    "proxy": ("kvserve.server.proxy", "proxy", "OpenAI-compatible front for disaggregated prefill/decode"),
    "bench": ("kvserve.tools.bench", "bench", "benchmark a workload through kvserve and a peer, side by side"),
    "eval-kv": ("kvserve.tools.evalkv", "evalkv", "quality drift of quantized KV cache dtypes"),
}


def _add_tools(sub: argparse._SubParsersAction) -> None:
    for command, (module_name, stem, help_text) in _TOOLS.items():
        module = importlib.import_module(module_name)
        parser = sub.add_parser(command, help=help_text)
        getattr(module, f"add_{stem}_arguments")(parser)
        parser.set_defaults(func=getattr(module, f"main_{stem}"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as err:
        print(f"kvserve: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
