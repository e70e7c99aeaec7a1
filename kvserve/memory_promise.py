"""The memory a server may grow to: weights + KV page pool + host tier (swap and offload), plus the
disk tier when there is one. `kvserve serve` logs it at start-up and `kvserve plan` prints it, from
the same function, so the operator sees the same sum in both places."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import format_bytes


@dataclass(frozen=True, slots=True)
class MemoryPromise:
    weights_bytes: int
    kv_pool_bytes: int
    host_tier_bytes: int
    disk_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """Process memory (RAM, or accelerator + RAM) once the KV pool and host tier are full."""
        return self.weights_bytes + self.kv_pool_bytes + self.host_tier_bytes

    def line(self) -> str:
        text = (f"memory: weights {format_bytes(self.weights_bytes)} + KV pool "
                f"{format_bytes(self.kv_pool_bytes)} + host tier (--swap-space) "
                f"{format_bytes(self.host_tier_bytes)} = {format_bytes(self.memory_bytes)} this "
                f"process may grow to")
        if self.disk_bytes:
            text += f", plus a disk tier of {format_bytes(self.disk_bytes)}"
        return text


def memory_promise(weights_bytes: int, kv_pool_bytes: int, host_tier_bytes: int,
                   disk_bytes: int = 0) -> MemoryPromise:
    return MemoryPromise(int(weights_bytes), int(kv_pool_bytes), int(host_tier_bytes),
                         int(disk_bytes or 0))
