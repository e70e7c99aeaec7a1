"""kvserve: an LLM inference server built around its KV cache. Public API: LLM, SamplingParams, RequestOutput."""

import os

# OpenMP threads that wait at a barrier sleep instead of spinning (read once, when torch loads its
# OpenMP runtime, so it is set before anything imports torch; $OMP_WAIT_POLICY overrides it). On a
# busy host a spinning thread holds the core its descheduled partner needs: at load 8 on 2 cores a
# native decode step took 1.8-3.1 s spinning against 49-52 ms passive (docs/performance.md, Round 3).
# They sleep after a short spin (libgomp's pause loop, 300 turns: microseconds), which catches a
# partner that is a moment behind: a step makes ~150 parallel regions, and a futex wake-up on a VM
# costs ~40 us each. W1 decode step at 1.5k context, 2 threads, Zen 5 (docs/performance.md): alone
# 14.1 -> 5.5 ms; beside two busy processes 26.8 -> 13.2 ms; beside one 10.7 -> 12.7 ms; two engines
# of 2 threads on 2 cores 10.2 -> 13.6 ms (there, give each `--threads 1`, or set GOMP_SPINCOUNT=0).
# Those figures were OpenMP's running the native kernels; the kernels now run on their own thread team
# (kvserve/kernels/src/team.h, KVSERVE_TEAM_SPIN_US), and these settings govern torch's own ops.
#
# torch's CPU allocator puts blocks of 2 MB and more on transparent huge pages (read at its first
# allocation). A buffer's first touch is then one fault per 2 MB, not per 4 KB: the first 1.5k-token
# prefill after start-up faulted 44k times (0.8 s of system time on this project's VMs) with 4 KB
# pages, 5.6k with huge ones (docs/performance.md, "First touch").
RUNTIME_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300", "THP_MEM_ALLOC_ENABLE": "1"}
# which of them kvserve set (not the user), inherited by child processes: benchmark peers run without
# them (kvserve.tools.bench), with their own runtime's defaults
_SET_HERE = "KVSERVE_RUNTIME_DEFAULTS_SET"
if _SET_HERE not in os.environ:
    # GOMP_SPINCOUNT belongs to the passive policy: with the user's OMP_WAIT_POLICY=ACTIVE, a spin count of
    # 300 would put their spinning threads to sleep after microseconds, silently undoing what they asked for
    _ours = [k for k in RUNTIME_DEFAULTS if k not in os.environ]
    if "OMP_WAIT_POLICY" not in _ours:
        _ours = [k for k in _ours if k != "GOMP_SPINCOUNT"]
    os.environ[_SET_HERE] = ",".join(_ours)
for _key in os.environ[_SET_HERE].split(","):
    if _key in RUNTIME_DEFAULTS:
        os.environ.setdefault(_key, RUNTIME_DEFAULTS[_key])


def peer_environment() -> dict[str, str]:
    """This process's environment less the runtime settings kvserve made (the user's own are kept)."""
    ours = set(os.environ.get(_SET_HERE, "").split(","))
    return {k: v for k, v in os.environ.items() if k not in ours and k != _SET_HERE}


from kvserve.beam_search import BeamSearchParams  # noqa: E402
from kvserve.request import CompletionOutput, RequestOutput  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402
from kvserve.structured.params import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "StructuredOutputsParams"]


def __getattr__(name: str):
    if name == "__version__":  # one source: pyproject.toml's, as installed
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("kvserve")
        except PackageNotFoundError:  # a source tree on sys.path, never installed (semver and PEP 440 alike)
            return "0.0.0+unknown"
    # The engine pulls in torch; import it only when asked so the cache layer and tools stay light.
    if name == "LLM":
        from kvserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvserve.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
