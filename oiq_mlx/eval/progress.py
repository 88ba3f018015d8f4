"""Progress lines on stderr for the long evaluations: elapsed time, and an ETA from the work done."""

from __future__ import annotations

import sys
import time


class Progress:
    """Lines on stderr with elapsed time, throughput and ETA."""

    def __init__(self, stream=sys.stderr, enabled: bool = True):
        self.stream, self.enabled = stream, enabled
        self.start = time.perf_counter()

    def __call__(self, msg: str):
        if self.enabled:
            print(f"[{fmt_s(time.perf_counter() - self.start)}] {msg}", file=self.stream, flush=True)


def fmt_s(s: float) -> str:
    """``s`` seconds as ``MmSSs``, rounded to the second."""
    s = max(0, round(s))
    return f"{s // 60}m{s % 60:02d}s"


def eta(done: float, total: float, elapsed: float) -> str:
    """Time left once ``done`` of ``total`` took ``elapsed`` seconds, at the same rate (``"?"`` before any)."""
    if done <= 0:
        return "?"
    return fmt_s(elapsed * (total - done) / done)
