"""`kvserve serve`: API keys from flags, a file or the environment; the memory promise at start-up;
uvicorn with a bounded shutdown.

On SIGTERM (or SIGINT) the server stops accepting and new requests on open connections get a 503;
in-flight requests run for `--shutdown-timeout` seconds, then every one still running is aborted
(streams end with finish_reason "abort" and an error event), the engine stops with no page in use,
the tier writer is flushed, and the process exits 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

log = logging.getLogger("kvserve.server")
API_KEYS_ENV = "KVSERVE_API_KEYS"


def load_api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key, then --api-key-file (one per line), then $KVSERVE_API_KEYS; duplicates once."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        keys += read_key_file(args.api_key_file, "--api-key-file")
    keys += [k for k in re.split(r"[\s,]+", os.environ.get(API_KEYS_ENV, "")) if k]
    for key in keys:
        if any(ch.isspace() for ch in key):
            raise ValueError("an API key cannot contain whitespace")
    return list(dict.fromkeys(keys))


def event_token_ids(choice: str, has_api_keys: bool, has_curve_key: bool) -> tuple[bool, str]:
    """Whether KV events carry `BlockStored.token_ids` (--kv-events-token-ids), and why: with API
    keys and no CURVE key on the events socket, any local user who subscribes would read every
    tenant's prompts, so "auto" keeps them in the process unless the operator says "on"."""
    if choice == "on":
        return True, "--kv-events-token-ids on"
    if choice == "off":
        return False, "--kv-events-token-ids off"
    if has_api_keys and not has_curve_key:
        return False, ("API keys are set and the events socket has no CURVE key "
                       "(--kv-events-token-ids on sends them, for llm-d or Dynamo)")
    return True, "no API keys" if not has_api_keys else "the events socket is CURVE-encrypted"


def read_secret_file(path: str | None) -> bytes | None:
    """--metrics-tenant-secret-file: its bytes (stripped), at least 16; None without the flag."""
    if not path:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as err:
        raise ValueError(f"cannot read --metrics-tenant-secret-file {path}: {err}") from None
    if len(secret) < 16:
        raise ValueError(f"--metrics-tenant-secret-file {path} holds {len(secret)} bytes; put at least 16")
    return secret


def read_key_file(path: str, flag: str) -> list[str]:
    """Keys one per line, blank lines and # comments skipped; at least one."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {flag} {path}: {err}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"{flag} {path} holds no key; put one per line")
    return keys


def weights_bytes(engine) -> int:
    """Bytes of the distinct tensor storages behind the built model and any float copy the loader
    holds (reading `loaded.weights` here would dequantize the whole model just to count it)."""
    held = getattr(engine.loaded, "held_weights", None)
    tensors = held() if held is not None else []
    model = getattr(engine.runner, "model", None)
    if hasattr(model, "state_dict"):
        tensors += list(model.state_dict().values())
    drafter = getattr(engine.runner, "drafter", None)  # a draft model (speculative decoding)
    if drafter is not None:
        tensors += list(drafter.runner.model.state_dict().values())
    storages: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def engine_memory_promise(engine, args: argparse.Namespace | None, measured: bool = False):
    """The start-up memory line's numbers; `measured`: with this process's resident memory now, the
    in-flight body cap and one step's activations (an expectation, not a bound: memory_promise.py)."""
    from kvserve.config import parse_bytes
    from kvserve.memory_promise import memory_promise, resident_bytes, step_activation_bytes

    config, model = engine.config, engine.loaded.config  # (--kv-disk-bytes counts only with a --kv-disk-path)
    disk = parse_bytes(config.kv_disk_bytes) if config.kv_disk_path else 0
    body = getattr(args, "max_body_bytes_in_flight", 0) if measured else 0
    step = step_activation_bytes(model.hidden_size, model.intermediate_size, model.vocab_size,
                                 config.max_num_batched_tokens, config.max_num_seqs) if measured else 0
    pool = engine.runner.kv_cache_bytes()
    on_demand = pool if measured and engine.runner.device.type == "cpu" else 0  # (host_heap.zeroed's pages)
    return memory_promise(weights_bytes(engine), pool, parse_bytes(config.swap_space),
                          disk, resident_bytes() if measured else 0, body, step, on_demand)


class _Drain:
    """After the first signal: no new requests; after `timeout_s`, abort what is still running."""

    def __init__(self, app, timeout_s: float) -> None:
        self.door = app.state.door  # every route's requests are held there (front.py)
        self.engine = app.state.engine
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.num_aborted = 0

    def begin(self) -> None:
        """Called in the signal handler: only flags and a thread (no locks, no logging here)."""
        self.door.draining = True
        threading.Thread(target=self._wait, name="kvserve-drain", daemon=True).start()

    def _wait(self) -> None:
        log.info("shutting down: stopped accepting; %d requests in flight get up to %g s to finish",
                 self.door.num_in_flight, self.timeout_s)
        if self.done.wait(self.timeout_s):
            return
        self.num_aborted = self.door.num_in_flight
        self.door.abort_note = (f"the server is shutting down: this request was stopped after "
                                f"the {self.timeout_s:g} s shutdown timeout")
        log.warning("shutdown timeout (%g s): aborting %d requests still in flight",
                    self.timeout_s, self.num_aborted)
        self.engine.abort_all(self.door.abort_note)


def serve(args: argparse.Namespace) -> int:
    from kvserve.server.listen import bind_server_socket

    from kvserve.server.inflight import InFlightCaps

    setup_logging(args.log_level)
    InFlightCaps(args.max_body_bytes_in_flight, args.max_body_bytes_per_key).check(args.max_request_bytes)
    api_keys = load_api_keys(args)
    admin_keys = read_key_file(args.admin_api_key_file, "--admin-api-key-file") if args.admin_api_key_file else []
    # before torch is imported and the model loads: a port in use fails within a second
    listener = bind_server_socket(args.host, args.port)
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.engine_args import engine_kwargs
    from kvserve.kv_events import fill_topic, pod_ip
    from kvserve.server.api import build_app, default_model_name
    from kvserve.startup_checks import check_event_socket

    token_ids, why = event_token_ids(args.kv_events_token_ids, bool(api_keys or admin_keys),
                                     bool(args.kv_events_curve_secret_file))
    args.kv_events_token_ids = "on" if token_ids else "off"
    kwargs = engine_kwargs(args)
    config = EngineConfig(model=args.model, role=args.role, **kwargs)
    check_event_socket(config)  # (LLMEngine checks it too; here before anything is logged)
    if args.kv_events_endpoint:
        log.info("KV events %s token ids: %s", "carry" if token_ids else "carry no", why)
    engine = LLMEngine(config)
    log.info("%s", engine_memory_promise(engine, args, measured=True).line())
    if engine.gpu_budget is not None:
        log.info("%s: %d tokens of KV", engine.gpu_budget.describe(),
                 (engine.cache_config.num_pages - 1) * engine.cache_config.page_size)
    if engine.runner.kernel_tuning is not None:
        from kvserve import kernels

        log.info("native kernels (%s): %s", kernels.library().isa, engine.runner.kernel_tuning.label())
    import torch

    log.info("engine threads: %d (%s; --threads to change)", torch.get_num_threads(),
             "given" if args.threads else "every usable core, as llama-server uses")
    # no structured-outputs warm-up: the first constrained request preprocesses the vocabulary (and
    # logs its cost), as vLLM does; a server that never gets one never holds it (~220 MB for
    # Gemma 3's 262k tokens, docs/structured_outputs.md)
    served_name, *more_names = args.served_model_name or [None]
    caps = InFlightCaps(args.max_body_bytes_in_flight, args.max_body_bytes_per_key, args.max_connections_per_key)
    app = build_app(engine, model_name=served_name, api_keys=api_keys or None,
                    admin_api_keys=admin_keys,
                    shared_cache_namespace=args.shared_cache_namespace,
                    extra_model_names=[*more_names, *([args.model] if args.model else [])],
                    max_request_bytes=args.max_request_bytes,
                    max_waiting_requests=args.max_waiting_requests,
                    max_requests_per_tenant=args.max_requests_per_tenant,
                    metrics_name_prefix=args.metrics_name_prefix,
                    metrics_tenant_labels=args.metrics_tenant_labels,
                    metrics_tenant_secret=read_secret_file(args.metrics_tenant_secret_file),
                    metrics_v0_names=args.metrics_v0_names,
                    read_timeout_s=args.request_read_timeout,
                    max_unauthenticated=args.max_unauthenticated_connections, in_flight_caps=caps,
                    reasoning_format=args.reasoning_format)
    if engine.event_publisher is not None:  # the topic's {pod_ip}, {port} and {model}
        engine.event_publisher.set_topic(fill_topic(
            engine.config.kv_events_topic, pod_ip=pod_ip(engine.config.kv_events_endpoint),
            port=args.port, model=served_name or default_model_name(engine)))
    # what start-up built (model, tokenizer, pools) lives as long as the server: kept out of the
    # collector's full passes, which otherwise rescan it and stall the event loop
    gc.collect()
    gc.freeze()
    drain = _Drain(app, args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = _DrainingServer(config, drain.begin)
    # uvicorn re-raises the signal it caught once it has shut down; a SIGTERM that was handled
    # (drained) must end in exit status 0, not in the default handler's death by signal
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[listener])
    finally:
        drain.done.set()
        signal.signal(signal.SIGTERM, previous)
        engine.close()  # flushes the Redis tier writer
        log.info("kvserve stopped: %d requests aborted at the shutdown timeout, %d pages in use, "
                 "tier writer flushed", drain.num_aborted, engine.num_used_pages)
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal also starts the drain."""

    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_first_signal = on_first_signal

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.on_first_signal()
        super().handle_exit(sig, frame)


def setup_logging(level: str) -> None:
    """kvserve's own log lines (memory promise, tier warnings, shutdown) beside uvicorn's."""
    logger = logging.getLogger("kvserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
