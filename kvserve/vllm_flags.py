"""vLLM's spellings of the engine flags, meaning what they mean in vLLM: `--block-size` (the page
size), `--enable-prefix-caching` / `--no-enable-prefix-caching`, `--kv-cache-memory-bytes`, and
`--swap-space` in GiB when it has no unit. (`--kv-cache-dtype fp8` and `--dtype half` are aliases in
config.py, so the Python API takes them too.)"""

from __future__ import annotations

import argparse

from kvserve.config import PrefixCachePolicy
from kvserve.units import is_bare_number


def add_vllm_flags(group: argparse._ArgumentGroup) -> None:
    """Called after kvserve's own flags, so that each field's kvserve flag stays its first spelling."""
    group.add_argument("--block-size", dest="page_size", type=int, default=argparse.SUPPRESS,
                       help="vLLM's name for --page-size (tokens per KV page)")
    group.add_argument("--enable-prefix-caching", "--no-enable-prefix-caching", dest="prefix_cache",
                       action=_PrefixCaching, default=argparse.SUPPRESS,
                       help="vLLM's switch: --no-enable-prefix-caching is --prefix-cache off; "
                            "--enable-prefix-caching keeps --prefix-cache (radix unless it says hash)")
    group.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", default=argparse.SUPPRESS,
                       help="vLLM's name for --kv-cache-memory (a number is bytes there too)")


class _PrefixCaching(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string: str | None = None) -> None:
        if option_string.startswith("--no-"):
            setattr(namespace, self.dest, PrefixCachePolicy.OFF.value)
        elif getattr(namespace, self.dest) == PrefixCachePolicy.OFF.value:
            setattr(namespace, self.dest, PrefixCachePolicy.RADIX.value)


def swap_space(value: str | int) -> str | int:
    """--swap-space as vLLM reads it: a number without a unit is GiB ("4" -> "4GiB"); with a unit
    (4GiB, 512MiB, 2e9B) it is what it says."""
    if is_bare_number(value):
        return f"{value.strip()}GiB"
    return value
