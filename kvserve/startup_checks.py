"""Checks of the engine's configuration against the machine, made before the model loads: a device
torch cannot use, or a KV budget larger than the memory there is, is one line at once rather than a
torch traceback after the load; so is a KV event stream sent in plain text to another machine."""

from __future__ import annotations

import os

from kvserve.config import EngineConfig, format_bytes, parse_bytes
from kvserve.errors import ConfigError


def check_machine(config: EngineConfig) -> None:
    check_event_socket(config)
    check_device(config.device)
    if config.device.split(":")[0] == "cpu" and config.kv_cache_memory is not None:  # (None: a default that fits)
        check_host_memory(parse_bytes(config.kv_cache_memory), machine_memory_bytes())


def check_event_socket(config: EngineConfig) -> None:
    """--kv-events-mode connect to another machine without CURVE sends every event (block hashes,
    token ids) across the network in plain text: refused unless --kv-events-allow-plaintext."""
    from kvserve.kv_events.wire import is_loopback

    endpoint = config.kv_events_endpoint
    if (endpoint and config.kv_events_mode == "connect" and not is_loopback(endpoint)
            and not config.kv_events_curve_secret_file and not config.kv_events_allow_plaintext):
        raise ConfigError(f"--kv-events-mode connect to {endpoint} would send KV events in plain text to "
                          f"another machine; set a CURVE key (--kv-events-curve-secret-file) or pass "
                          f"--kv-events-allow-plaintext")


def check_device(device: str) -> None:
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r} is not a device torch knows; use cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise ConfigError(f"--device {device}: this torch ({torch.__version__}) is a CPU-only build; "
                              f"install a CUDA build of torch or use --device cpu")
        raise ConfigError(f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no "
                          f"GPU; check the driver and CUDA_VISIBLE_DEVICES, or use --device cpu")


def check_host_memory(kv_cache_bytes: int, machine_bytes: int | None) -> None:
    """The KV pool alone must fit in the machine's memory (its weights and the rest come on top)."""
    if machine_bytes is not None and kv_cache_bytes > machine_bytes:
        raise ConfigError(f"--kv-cache-memory {format_bytes(kv_cache_bytes)} is more than this machine's "
                          f"{format_bytes(machine_bytes)} of memory; lower --kv-cache-memory "
                          f"(`kvserve plan` sizes it for a context and concurrency)")


def machine_memory_bytes() -> int | None:
    """Physical memory, or the container's cgroup limit when that is lower; None where unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total
