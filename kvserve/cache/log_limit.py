"""Warnings that repeat, one line per kind every `every_s` seconds: a full or failing disk fails
every page write, and a line per page buried the log (460 warnings for 4 requests). The next line of
a kind says how many were held back since the last."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class LogLimit:
    logger: logging.Logger
    every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _held: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def warning(self, kind: str, message: str, *args) -> None:
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.every_s:
                self._held[kind] += 1
                return
            held = self._held.pop(kind, 0)
            self._last[kind] = now
        if held:
            message += f" ({held} more like it held back in the last {self.every_s:g} s)"
        self.logger.warning(message, *args)
