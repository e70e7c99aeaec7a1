"""The HTTP side of kvserve: an OpenAI-compatible FastAPI app (`api.build_app`), its request schema
(`protocol`), the completion work (`serving`, `render`), and the live KV-cache dashboard.

`kvserve serve` flags live here, not in api.py, so that building the CLI parser imports neither
FastAPI nor torch."""

from __future__ import annotations

import argparse


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine_args import add_engine_arguments

    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on /v1 (repeat for several "
                             "tenants; each key gets its own prefix-cache namespace)")
    parser.add_argument("--shared-cache-namespace", action="store_true",
                        help="let all API keys share one prefix cache")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model's own name)")
    parser.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                        help="disaggregated serving behind `kvserve proxy`: prefill computes each "
                             "prompt and publishes its pages to --redis-url, decode loads them")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(parser)


def main_serve(args: argparse.Namespace) -> int:
    from kvserve.server.api import serve

    return serve(args)
