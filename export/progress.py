"""Where an export's time goes: seconds per stage, and a line per graph as each one is done.

A whole model's export runs for minutes (SmolLM2-135M: 40 graphs over four windows; a 0.6B model a quarter of an
hour), so it says what it did as it goes, `[k/N] prefill.ort.w256.onnx ... (elapsed)`, one plain line each (a log
reads the same as a terminal), and ends with the split: trace, passes, checks, sequence parity, quantization. On a
terminal (`bar`), a progress bar under those lines shows the stage running now and how many graphs are made and
checked of all.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict


class Progress:
    def __init__(self, total: int, log=print, bar: bool = False):
        self.total, self.done = total, 0
        self.seconds: dict[str, float] = defaultdict(float)
        self.start = time.perf_counter()
        self._bar = None
        if bar:  # every graph is made, then checked: twice `total` steps
            from tqdm import tqdm
            self._bar = tqdm(total=2 * total, unit="graph", file=sys.stderr, dynamic_ncols=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
        # lines go above the bar, not through it
        self.log = (lambda line: self._bar.write(line, file=sys.stdout)) if self._bar is not None else log

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time the block as part of stage `name`."""
        t = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(name)
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t

    def made(self, count: int, what: str) -> None:
        """`count` graphs made (traced, rewritten, saved): say which, and how long the export has run."""
        self._advance(count)
        self.log(f"{what} ({self.elapsed():.0f} s)")

    def graph(self, what: str) -> None:
        """One more graph of `total` is checked: say which, and how long the export has run."""
        self.done += 1
        self._advance(1)
        self.log(f"[{self.done}/{self.total}] {what} ({self.elapsed():.0f} s)")

    def _advance(self, count: int) -> None:
        if self._bar is not None:
            self._bar.update(count)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def summary(self) -> str:
        """'time: 412 s (trace 180 s, passes 150 s, ...)', the stages in the order they first ran; the bar closed."""
        if self._bar is not None:
            self._bar.close()
        return f"time: {self.elapsed():.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items()) + ")"
