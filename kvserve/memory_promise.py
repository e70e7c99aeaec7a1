"""The memory a server grows to, and what the line cannot bound. Its parts that `kvserve plan` can
compute: weights + KV page pool + host tier (swap and offload), plus the disk tier when there is one.
`kvserve serve` adds what it measures at start-up: the process's resident memory then (the
interpreter, torch, the tokenizer and kernels besides the weights, which are resident by then), and what
comes on top of it: a CPU KV pool (its pages become resident as requests first write them), the host tier
(filled on demand), request bodies still arriving (--max-body-bytes-in-flight) and an estimate of one
step's activations, summed as what to expect.
Not bounded, and named in the line: grammar matchers (the first constrained request preprocesses the
vocabulary: 58 MiB for SmolLM2's 49,152 tokens), stored responses and the allocator's slack under
concurrent requests (glibc keeps per-thread arenas; a busy peak with 4 clients was up to 31 MiB
above the sum).
Both commands print it from this module, so the operator sees the same sum in both places."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import format_bytes

LEFT_OUT = ("grammar matchers (the first constrained request adds ~1.2 KB per vocabulary token), stored "
            "responses and the allocator's slack under concurrent requests")
FLOAT_BYTES = 4  # activations are float32 (bf16 halves them; the bound stays a bound)


@dataclass(frozen=True, slots=True)
class MemoryPromise:
    weights_bytes: int
    kv_pool_bytes: int
    host_tier_bytes: int
    disk_bytes: int = 0
    resident_bytes: int = 0  # measured at start-up (serve); 0: not measured (plan)
    body_bytes: int = 0  # --max-body-bytes-in-flight (serve)
    activation_bytes: int = 0  # one step's activations, estimated (step_activation_bytes)
    pool_on_demand_bytes: int = 0  # the KV pool's pages not resident at start-up (a CPU pool: all of them)

    @property
    def memory_bytes(self) -> int:
        """Weights, the KV pool and the host tier once full (RAM, or accelerator + RAM)."""
        return self.weights_bytes + self.kv_pool_bytes + self.host_tier_bytes

    @property
    def expected_bytes(self) -> int:
        """What to expect the process to grow to: resident at start-up + the KV pool's pages written later +
        the host tier + bodies in flight + a step's activations (without a measurement: the model's state
        alone)."""
        if not self.resident_bytes:
            return self.memory_bytes
        return (self.resident_bytes + self.pool_on_demand_bytes + self.host_tier_bytes + self.body_bytes
                + self.activation_bytes)

    def line(self) -> str:
        text = (f"memory: weights {format_bytes(self.weights_bytes)} + KV pool "
                f"{format_bytes(self.kv_pool_bytes)} + host tier (--swap-space) "
                f"{format_bytes(self.host_tier_bytes)} = {format_bytes(self.memory_bytes)}")
        if self.resident_bytes:
            pool = " the KV pool as requests fill it," if self.pool_on_demand_bytes else ""
            text += (f"; resident at start-up {format_bytes(self.resident_bytes)} (with the interpreter, torch "
                     f"and the tokenizer); expect about {format_bytes(self.expected_bytes)} with{pool} the host "
                     f"tier, request bodies in flight (up to {format_bytes(self.body_bytes)}, "
                     f"--max-body-bytes-in-flight) and a step's activations (about "
                     f"{format_bytes(self.activation_bytes)}); not bounded here: {LEFT_OUT}")
        else:
            text += (" for the model's state (the interpreter, torch and the tokenizer add a few hundred MB; "
                     f"activations, {LEFT_OUT} come on top)")
        if self.disk_bytes:
            text += f", plus a disk tier of {format_bytes(self.disk_bytes)}"
        return text


def memory_promise(weights_bytes: int, kv_pool_bytes: int, host_tier_bytes: int,
                   disk_bytes: int = 0, resident_bytes: int = 0, body_bytes: int = 0,
                   activation_bytes: int = 0, pool_on_demand_bytes: int = 0) -> MemoryPromise:
    return MemoryPromise(int(weights_bytes), int(kv_pool_bytes), int(host_tier_bytes),
                         int(disk_bytes or 0), int(resident_bytes), int(body_bytes), int(activation_bytes),
                         int(pool_on_demand_bytes))


def step_activation_bytes(hidden_size: int, intermediate_size: int, vocab_size: int,
                          max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """One step's activations at most: per token a residual stream, the attention's q/k/v/out and
    norms (~8 x hidden) and the MLP's gate/up/act (~3 x intermediate); per sampled row its logits and
    the sampler's working copies (~4 x vocab). Measured on SmolLM2: 16 MiB for a 470-token prefill,
    this gives 17.7 MiB."""
    per_token = 8 * hidden_size + 3 * intermediate_size
    return FLOAT_BYTES * (max_num_batched_tokens * per_token + 4 * max_num_seqs * vocab_size)


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS), 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0
