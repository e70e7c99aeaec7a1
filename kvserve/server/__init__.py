"""The HTTP side of kvserve: an OpenAI-compatible FastAPI app (`api.build_app`), its request schema
(`protocol`), the completion work (`serving`, `render`), and the live KV-cache dashboard.

`kvserve serve` flags live here, not in api.py, so that building the CLI parser imports neither
FastAPI nor torch."""

from __future__ import annotations

import argparse


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine_args import add_engine_arguments

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (same as --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on /v1 (repeat for several "
                             "tenants; each key gets its own prefix-cache namespace). Visible in "
                             "`ps`: prefer --api-key-file or $KVSERVE_API_KEYS")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="API keys, one per line (blank lines and # comments skipped), same "
                             "meaning as --api-key; $KVSERVE_API_KEYS adds keys separated by "
                             "commas or whitespace")
    parser.add_argument("--admin-api-key-file", default=None, metavar="FILE",
                        help="admin keys, one per line: valid API keys that also see across "
                             "tenants (the whole /v1/cache/report; other keys see their own part)")
    parser.add_argument("--max-request-bytes", type=_positive_int, default=4 << 20, metavar="N",
                        help="larger request bodies get a 413 before parsing (default 4 MiB)")
    parser.add_argument("--max-body-bytes-in-flight", type=_byte_size, default=256 << 20, metavar="N",
                        help="bytes of request bodies still arriving, all clients together; past it a "
                             "429 before more is read (default 256 MiB)")
    parser.add_argument("--max-body-bytes-per-key", type=_byte_size, default=64 << 20, metavar="N",
                        help="the same, per API key (default 64 MiB; at least --max-request-bytes)")
    parser.add_argument("--max-connections-per-key", type=_positive_int, default=128, metavar="N",
                        help="with API keys: requests one key may have open at once, a 429 for more "
                             "before any body is read (default 128)")
    parser.add_argument("--request-read-timeout", type=float, default=30.0, metavar="S",
                        help="a request body must arrive whole within S seconds, or the "
                             "connection gets a 408 and is closed (default 30)")
    parser.add_argument("--max-unauthenticated-connections", type=_positive_int, default=64,
                        metavar="N",
                        help="with API keys: at most N requests without a valid key are read "
                             "(and dropped) at once before their 401; more get it at once")
    parser.add_argument("--reasoning-format", choices=("auto", "none"), default="auto",
                        help="auto (llama-server's default): a thinking model's <think> text goes to "
                             "reasoning_content (Ollama: thinking), apart from content; none: left in content")
    parser.add_argument("--reasoning-parser", dest="reasoning_format", type=_think_parser, metavar="NAME",
                        help="vLLM's flag: deepseek_r1 or qwen3 (the <think> block) is --reasoning-format auto")
    parser.add_argument("--max-waiting-requests", type=_non_negative_int, default=0, metavar="N",
                        help="429 with Retry-After once N engine requests (prompts x n) are "
                             "waiting beyond those running (default 0: no limit)")
    parser.add_argument("--max-requests-per-tenant", type=_non_negative_int, default=0,
                        metavar="N",
                        help="429 once one API key holds N engine requests, waiting or running "
                             "(default 0: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, let in-flight requests finish for S seconds, then "
                             "abort the rest (default 30)")
    parser.add_argument("--shared-cache-namespace", action="store_true",
                        help="let all API keys share one prefix cache")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name clients send (default: the model's own name); several "
                             "names are all accepted and the first is answered, as in vLLM")
    parser.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                        help="disaggregated serving behind `kvserve proxy`: prefill computes each "
                             "prompt and publishes its pages to --redis-url, decode loads them")
    parser.add_argument("--metrics-name-prefix", default="kvserve", choices=["kvserve", "vllm"],
                        help="vllm: /metrics under vLLM's names and labels (vllm:num_requests_waiting, "
                             "...), for scrapers that cannot be configured (llm-d's default picker); "
                             "`kvserve router` reads the kvserve names")
    parser.add_argument("--metrics-v0-names", action="store_true",
                        help="with --metrics-name-prefix vllm: also vLLM V0's vllm:cpu_cache_usage_perc and "
                             "vllm:num_requests_swapped, which vLLM V1 no longer exports")
    parser.add_argument("--metrics-tenant-labels", default="keyed", choices=["keyed", "off"],
                        help="keyed: per-tenant /metrics series labelled by an HMAC of the tenant "
                             "under a server secret (the admin's /v1/cache/report maps them); off: "
                             "no per-tenant series")
    parser.add_argument("--metrics-tenant-secret-file", default=None, metavar="FILE",
                        help="the HMAC secret of the tenant labels (at least 16 bytes), so that "
                             "restarts and replicas label a tenant alike (default: random per start)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(parser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _byte_size(text: str) -> int:
    from kvserve.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or more, got {value}")
    return value


def _think_parser(name: str) -> str:
    """vLLM's reasoning parsers that read a <think> block; kvserve's splitter reads it (reasoning.py)."""
    if name not in ("deepseek_r1", "qwen3"):
        raise argparse.ArgumentTypeError(f"kvserve reads <think> blocks (vLLM's deepseek_r1 and qwen3 parsers), "
                                         f"not {name!r}; leave it out (--reasoning-format auto is the default)")
    return "auto"


def main_serve(args: argparse.Namespace) -> int:
    from kvserve.errors import ConfigError
    from kvserve.server.launch import serve

    if args.model_tag is not None:  # `kvserve serve MODEL`, vLLM's spelling
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    return serve(args)
