"""Memory sizes as users write them on the command line and in the Python API ('1GiB', '512MiB',
'2e9', or a number of bytes), read in one place, and sizes and counts as messages print them."""

from __future__ import annotations

import re

from kvserve.errors import ConfigError

_NUMBER = r"[0-9]*\.?[0-9]+(?:e[0-9]+)?"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "t": 1000**4,
          "tb": 1000**4}


def parse_bytes(value: str | int | float) -> int:
    """'1GiB', '512MiB', '2e9', 1_000_000 -> bytes."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"a memory size cannot be negative: {value}")
        return int(value)
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read memory size {value!r}; write it like 512MiB, 1GiB or 2e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def is_bare_number(value: str | int | float) -> bool:
    """Text that is a number with no unit ('4', '0.5', '2e9'): flags whose unit is not bytes (vLLM's
    --swap-space in GiB) read it in their own unit."""
    return isinstance(value, str) and re.fullmatch(rf"\s*{_NUMBER}\s*", value) is not None


def format_bytes(num: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num >= size:
            return f"{num / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{num:.0f} B"


def format_number(num: float) -> str:
    return f"{num:,.0f}" if float(num).is_integer() else f"{num:,.2f}"
