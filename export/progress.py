"""Where an export's time goes: seconds per stage, and a line per graph as each one is done.

A whole model's export runs for minutes (SmolLM2-135M: 40 graphs over four windows), so it says what it did as it
goes, `[k/N] prefill.ort.w256.onnx ... (elapsed)`, one plain line each (a log reads the same as a terminal), and
ends with the split: trace, passes, checks, sequence parity, quantization.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict


class Progress:
    def __init__(self, total: int, log=print):
        self.total, self.done, self.log = total, 0, log
        self.seconds: dict[str, float] = defaultdict(float)
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time the block as part of stage `name`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t

    def graph(self, what: str) -> None:
        """One more graph of `total` is done: say which, and how long the export has run."""
        self.done += 1
        self.log(f"[{self.done}/{self.total}] {what} ({self.elapsed():.0f} s)")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def summary(self) -> str:
        """'time: 412 s (trace 180 s, passes 150 s, ...)', the stages in the order they first ran."""
        return f"time: {self.elapsed():.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items()) + ")"
