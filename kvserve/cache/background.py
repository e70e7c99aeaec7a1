"""The drain-then-stop of the background writer threads (disk tier, KV event publisher): each has a
work queue whose items are marked done, and a None that tells its thread to end."""

from __future__ import annotations

import queue
import threading
import time


def drain(work: queue.Queue, timeout: float) -> bool:
    """Wait until every queued item was processed (task_done); False if `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while work.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def stop(work: queue.Queue, thread: threading.Thread, timeout: float) -> None:
    """Let the thread finish what is queued (up to `timeout`), then end it."""
    if thread.is_alive():
        drain(work, timeout)
        work.put(None)
        thread.join(timeout)
