"""`kvserve router`: one OpenAI/Anthropic endpoint in front of several `kvserve serve` instances that
sends each request where its prompt's pages already are.

    client -> router: /tokenize on a backend -> page hashes (cache/hashing.py, the request's namespace)
                      -> rank backends (router_index.rank: cached prefix vs load) -> the best one
                      (connection lost: mark it down, try the next; a stream broken mid-answer is
                      resumed on the next, router_stream.py)
    backend KV events (ZMQ, vLLM's schema) -> KVEventSubscriber -> BackendState.pages
    every poll interval: /health, /metrics (running, waiting, KV usage), /v1/kv_events_endpoint

Each backend describes its event stream at `GET /v1/kv_events_endpoint` (docs/scale-out.md), so the
router needs no flag per backend; keyed backends need the router's own key for it and for /tokenize
(`--backend-api-key-file`; clients' keys are forwarded as they came). With `--api-key-file` the
router checks clients' keys itself first (auth.KeyGate): a wrong key costs no backend any work. A router that follows no
backend's events says so at start-up: it would route by load alone.

A backend that refuses a connection, fails a health check or answers garbage is marked down and its
pages forgotten; when it answers again its stream is followed anew, from a replay of everything its
publisher still buffers. One that stops answering its health checks is marked down and the reads
still waiting on it end (router_reads.Alarm), so their requests move on; a read past its deadline
moves its request on without marking the backend down (it may only be busy). `Router` (the
decisions) is in router_core.py, the HTTP app in router_app.py, this module is the CLI. With `--policy round-robin`, or before a backend's events are known, requests go
round robin or to the least loaded. With `--prefill URL`, each request is first computed by a
prefill instance (max_tokens=1, pages to Redis) as `kvserve proxy` does, then routed.
"""

import argparse
from pathlib import Path

from kvserve.server.router_reads import ReadTimeouts


def load_backend_keys(path: str) -> dict[str, str]:
    """--backend-api-key-file: lines `KEY` (every backend) or `URL KEY` (that backend); blank lines
    and # comments skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read --backend-api-key-file {path}: {err}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ValueError(f"--backend-api-key-file {path}, line {number}: put `KEY` or "
                             f"`URL KEY` on a line")
        url, key = ("", fields[0]) if len(fields) == 1 else fields
        keys[url] = key
    if not keys:
        raise ValueError(f"--backend-api-key-file {path} holds no key")
    return keys


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.server.limits import DEFAULT_MAX_REQUEST_BYTES

    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a `kvserve serve` instance (repeat for several)")
    parser.add_argument("--policy", default="kv", choices=["kv", "round-robin"],
                        help="kv: by cached prefix against load (needs the backends' "
                             "--kv-events-endpoint); round-robin: in turn")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a `kvserve serve --role prefill` instance that computes each prompt "
                             "first (repeat for several); the --backend instances then decode")
    parser.add_argument("--backend-api-key-file", default=None, metavar="FILE",
                        help="the router's own key at backends started with API keys, for their "
                             "KV events description and /tokenize: a line `KEY` (every backend) "
                             "or `URL KEY` (one); clients' keys are forwarded as they came")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="clients' keys (one per line, as `kvserve serve --api-key-file`: give the "
                             "backends' keys): a request without one of them gets a 401 at the router, "
                             "before any backend is asked anything")
    parser.add_argument("--kv-events-curve-client-secret-file", default=None, metavar="FILE",
                        help="the router's own CURVE secret key for backends' KV event streams that "
                             "admit listed subscribers only (its public key in their "
                             "--kv-events-curve-clients-file)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        metavar="N", help="larger request bodies get a 413 before any backend "
                                          "sees them (default 4 MiB, as `kvserve serve`)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for a backend's whole (not streamed) answer")
    parser.add_argument("--first-byte-timeout", type=float, default=60.0, metavar="S",
                        help="seconds to wait for a stream's head and first output (its "
                             "prefill) before resuming it on another backend (default 60)")
    parser.add_argument("--chunk-timeout", type=float, default=30.0, metavar="S",
                        help="seconds to wait between two chunks of a stream before resuming it "
                             "on another backend (default 30)")
    parser.add_argument("--poll-interval", type=float, default=0.5,
                        help="seconds between health and load checks of each backend")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def _read_secret(path: str | None) -> str | None:
    if not path:
        return None
    from kvserve.kv_events.curve_clients import client_keys

    try:
        secret = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"cannot read --kv-events-curve-client-secret-file {path}: {err}") from None
    client_keys(secret)  # a malformed key: one line now, not a subscriber that never connects
    return secret


def main_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.server.launch import setup_logging
    from kvserve.server.router_app import build_router_app

    setup_logging(args.log_level)  # the router's own lines (backends up and down, decisions)
    for flag in ("poll_interval", "timeout", "first_byte_timeout", "chunk_timeout",
                 "max_request_bytes"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    from kvserve.server.launch import read_key_file

    keys = load_backend_keys(args.backend_api_key_file) if args.backend_api_key_file else None
    client_keys = read_key_file(args.api_key_file, "--api-key-file") if args.api_key_file else None
    timeouts = ReadTimeouts(args.first_byte_timeout, args.chunk_timeout, args.timeout)
    app = build_router_app(args.backend, policy=args.policy, prefill_urls=args.prefill,
                           timeouts=timeouts, poll_interval_s=args.poll_interval,
                           backend_keys=keys, max_request_bytes=args.max_request_bytes,
                           api_keys=client_keys, curve_client_secret=_read_secret(args.kv_events_curve_client_secret_file))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
