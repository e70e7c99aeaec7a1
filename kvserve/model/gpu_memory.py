"""The KV pool's size on a GPU, as vLLM's `--gpu-memory-utilization` means it: the process may use
that fraction of the card's memory; the pool gets what is left after the weights (and whatever else
already holds memory on the device) and the activation peak of the largest step, measured by running
one such step at start-up.

    pool = utilization * total - in use after load - activation peak
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import format_bytes


@dataclass(frozen=True, slots=True)
class GpuMemoryBudget:
    utilization: float
    total_bytes: int  # the card's memory (torch.cuda.mem_get_info)
    in_use_bytes: int  # held on the device after the weights loaded: this process and any other
    activation_peak_bytes: int  # one profiled step of max_num_batched_tokens rows, above the weights

    @property
    def kv_cache_bytes(self) -> int:
        return max(0, int(self.utilization * self.total_bytes) - self.in_use_bytes - self.activation_peak_bytes)

    def describe(self) -> str:
        """The start-up line's breakdown (and the capacity error's)."""
        return (f"--gpu-memory-utilization {self.utilization:g} leaves {format_bytes(self.kv_cache_bytes)} for "
                f"the KV cache ({self.utilization:g} x {format_bytes(self.total_bytes)} - "
                f"{format_bytes(self.in_use_bytes)} in use after load - "
                f"{format_bytes(self.activation_peak_bytes)} activation peak)")


def measure_budget(utilization: float, device: torch.device, profile_step) -> GpuMemoryBudget:
    """Measure after the weights are on `device`: what the device holds now, then the peak that
    `profile_step()` (one forward of the largest step, with its own scratch KV) adds."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scratch_bytes = profile_step()
    torch.cuda.synchronize(device)
    peak = max(0, torch.cuda.max_memory_allocated(device) - base - scratch_bytes)
    torch.cuda.empty_cache()
    return GpuMemoryBudget(utilization, total, total - free, peak)
