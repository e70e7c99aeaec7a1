"""llama.cpp's `samplers` field (a list of names, or llama-server's letters, "edkypmxt" as its web UI sends it):
which of the penalties, top-k, top-p, min-p and the temperature run, and in which order, as SamplingParams'
fields. kvserve samples in llama.cpp's default order (the temperature last) or vLLM's (the temperature first);
a list that orders them otherwise is a 400."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# llama.cpp's sampler names and letters; those without a kvserve counterpart (dry, typ_p, xtc, top_n_sigma,
# infill) are refused at any other than their neutral value elsewhere (UNSUPPORTED_SAMPLERS), so listed they
# change nothing
LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
           "x": "xtc", "t": "temperature", "i": "infill"}
ORDERS = {True: ("top_k", "top_p", "min_p", "temperature"),  # llama.cpp's default: the temperature last
          False: ("temperature", "min_p", "top_k", "top_p")}  # vLLM's
MAX_SAMPLERS = 32
# llama-server's default chain (its /props lists it so)
LLAMA_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


@dataclass(frozen=True, slots=True)
class SamplerChain:
    listed: frozenset[str]
    temperature_last: bool

    @classmethod
    def parse(cls, samplers: list[str] | str) -> SamplerChain:
        """Raises ValueError saying what is wrong (an unknown name or letter, an order kvserve does not run)."""
        names = [LETTERS.get(c, c) for c in samplers] if isinstance(samplers, str) else list(samplers)
        if len(names) > MAX_SAMPLERS:
            raise ValueError(f"samplers lists at most {MAX_SAMPLERS} samplers, got {len(names)}")
        unknown = [n for n in names if n not in LETTERS.values()]
        if unknown:
            raise ValueError(f"samplers: unknown sampler {unknown[0]!r}; llama.cpp's are "
                             f"{', '.join(LETTERS.values())} (or their letters {''.join(LETTERS)})")
        ordered = [n for n in names if n in ORDERS[True]]
        for temperature_last, order in ORDERS.items():
            if ordered == sorted(ordered, key=order.index):
                return cls(frozenset(names), temperature_last)
        raise ValueError(f"samplers puts {', '.join(ordered)} in an order kvserve does not run; it runs "
                         f"llama.cpp's default order ({', '.join(ORDERS[True])}) or vLLM's "
                         f"({', '.join(ORDERS[False])})")

    def apply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams' `fields` with the samplers left out of the chain turned off, as llama.cpp leaves
        them out (no temperature: the untempered distribution, even at temperature 0)."""
        off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
        out = {**fields, **{name: value for name, value in off.items() if name not in self.listed},
               "temperature_last": self.temperature_last}
        if "penalties" not in self.listed:
            out.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        return out
