"""The `kvserve` command: subcommands parse their flags here and call into the engine or the tools.
User mistakes end as one line on stderr (`kvserve: error: ...`) and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

import kvserve
from kvserve.config import ConfigError
from kvserve.engine_args import add_engine_arguments, engine_kwargs

def main_generate(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                            repetition_last_n=None if args.repeat_last_n == -1 else args.repeat_last_n)
    llm = LLM(model=args.model, **engine_kwargs(args))
    print(_mode_line(llm.engine), file=sys.stderr)  # (stdout holds the answer alone)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    llm.engine.close()  # with --redis-url: the new pages reach Redis before the process ends
    print(output.outputs[0].text)
    return 0


class _OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as one line and a pointer to --help (not the whole usage first);
    subcommands' parsers are of this class too (add_subparsers takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _mode_line(engine) -> str:
    """generate's start-up line: the weight mode (and the kernels' instruction set) and the KV dtype."""
    from kvserve import kernels

    # the runner tunes the kernels where its matrices run on them (native, and float32 on CPU)
    weights = "the file's own formats" if engine.config.dtype == "native" else engine.config.dtype
    library = kernels.library() if engine.runner.kernel_tuning is not None else None
    if library is None:
        weights = f"{weights} (torch)"
    else:
        rows = kernels.library(1)
        isa = library.isa if rows is None or rows.isa == library.isa else f"{library.isa}, decode rows {rows.isa}"
        weights = f"{weights} on kvserve's native kernels ({isa})"
    return f"kvserve: weights: {weights}; KV cache: {engine.cache_config.kv_dtype.name}"


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="kvserve", description="An LLM inference server built around its KV cache.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repeat-penalty", type=float, default=1.0,
                     help="llama.cpp's repetition penalty over the last --repeat-last-n tokens (1: off)")
    gen.add_argument("--repeat-last-n", type=int, default=64, help="-1: the whole context")
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
    "router": ("kvserve.server.router", "router",
               "one endpoint for several instances, routing each request where its prefix is cached"),
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
