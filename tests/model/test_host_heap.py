"""The CPU engine's heap keeps what a step frees: later steps' buffers mostly reuse its pages."""

import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource
import torch
from kvserve.model.host_heap import retain_freed_memory
applied = retain_freed_memory()
faults = []
for _ in range(6):  # one prefill chunk's worth of activations, made and freed six times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(1547, 3072).fill_(1.0) for _ in range(3)]
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def run_child(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         env={**environ, **env}, timeout=120)
    return json.loads(out.stdout)


def test_freed_buffers_are_reused_without_page_faults():
    # the control: glibc with a fixed 128 KiB mmap threshold (its default before it adapts, which
    # it does by a history of frees: unfixed, the rounds it maps afresh vary from run to run) maps
    # 3 x 19 MB afresh every round (~14,000 faults of 4 KiB), and the user's setting turns ours off
    default = run_child(MALLOC_MMAP_THRESHOLD_="131072")
    retained = run_child()
    assert retained["applied"] and not default["applied"]
    # kept, the later rounds mostly reuse the first one's pages (a round may still grow the heap)
    assert min(default["faults"][1:]) > 1000, default
    assert sum(retained["faults"][1:]) < sum(default["faults"][1:]) / 4, (retained, default)


def test_the_users_malloc_settings_stand():
    assert not run_child(MALLOC_TRIM_THRESHOLD_="131072")["applied"]


ZEROED_CHILD = r"""
import json
import torch
from kvserve.model.host_heap import zeroed

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

warm = zeroed((4, 1 << 16), torch.bfloat16)  # torch's own first-use costs (a fill, the check below's
warm[1].fill_(1.0)                           # reduction), before anything is measured
bool(warm.view(torch.uint8)[0].any())
before = rss()
pool = zeroed((8, 2, 1024, 16, 4, 64), torch.bfloat16)  # 128 MiB
allocated = rss() - before
flat = pool.view(torch.uint8).view(-1)
# reading untouched pages maps the zero page: nothing becomes resident (1 MiB at a time: no large temporaries)
any_nonzero = any(bool(flat[i:i + (1 << 20)].any()) for i in range(0, flat.numel(), 1 << 20))
pool[3, 1, 7].fill_(2.5)
row = pool[3, 1, 7].float().sum().item()
written = rss() - before
pool.fill_(1.0)
filled = rss() - before
del pool, flat
print(json.dumps({"allocated": allocated, "all_zero": not any_nonzero, "row": row, "written": written,
                  "filled": filled, "freed": rss() - before}))
"""


def test_the_kv_pool_is_zero_and_costs_memory_only_where_written():
    """kv_quant.make_cache's pool on the CPU: zeros like torch.zeros, but resident only as pages are written
    (torch.zeros wrote the bundled model's 1 GiB at every start), and given back with the tensor."""
    out = subprocess.run([sys.executable, "-c", ZEROED_CHILD], capture_output=True, text=True, check=True,
                         timeout=120)
    got = json.loads(out.stdout)
    assert got["all_zero"] and got["row"] == 2.5 * 16 * 4 * 64
    assert got["allocated"] < 4 << 20 and got["written"] < 8 << 20, got  # one 2 MB page, not 128 MiB
    assert got["filled"] >= 128 << 20 and got["filled"] - got["freed"] >= 128 << 20, got
