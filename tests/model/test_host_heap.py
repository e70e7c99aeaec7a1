"""The CPU engine's heap keeps what a step frees: later steps' buffers mostly reuse its pages."""

import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys
import torch
from kvserve.model.host_heap import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "on" else False
faults = []
for _ in range(6):  # one prefill chunk's worth of activations, made and freed six times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(1547, 3072).fill_(1.0) for _ in range(3)]
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def run_child(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                         env={**environ, **env}, timeout=120)
    return json.loads(out.stdout)


def test_freed_buffers_are_reused_without_page_faults():
    default = run_child("off")
    retained = run_child("on")
    assert retained["applied"]
    # 3 x 19 MB a round: glibc's defaults map them afresh each time (~14,000 faults of 4 KiB); kept,
    # the later rounds mostly reuse the first one's pages (a round may still grow the heap a little)
    assert min(default["faults"][1:]) > 1000, default
    assert sum(retained["faults"][1:]) < sum(default["faults"][1:]) / 4, (retained, default)


def test_the_users_malloc_settings_stand():
    assert not run_child("on", MALLOC_TRIM_THRESHOLD_="131072")["applied"]
