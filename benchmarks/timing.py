"""Repeat a callable until its median is stable; report the spread and the peak resident memory."""
from __future__ import annotations

import time

import numpy as np

from runtime.cli import peak_rss_bytes


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, so the next read is this workload's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    peak = peak_rss_bytes()
    return float("nan") if peak is None else peak / 2**20


def measure(fn, min_reps: int, min_seconds: float, max_seconds: float, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        if (len(times) >= min_reps and elapsed >= min_seconds) or elapsed >= max_seconds:
            break
    ms = np.array(times) * 1e3
    return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()), "max_ms": float(ms.max()),
            "p90_ms": float(np.percentile(ms, 90)), "reps": len(times)}
