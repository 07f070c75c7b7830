"""The machine's own limits, measured in the same run: read bandwidth and fp32 GEMM throughput."""
from __future__ import annotations

import torch

from .timing import measure


def read_bandwidth(nbytes: int, threads: int) -> float:
    """Bytes/s reading an fp32 buffer of `nbytes` (a sum over it, all threads), median of repeats."""
    torch.set_num_threads(threads)
    x = torch.rand(max(nbytes // 4, 1024))
    t = measure(lambda: x.sum(), min_reps=50, min_seconds=0.3, max_seconds=2.0)
    return x.numel() * 4 / (t["median_ms"] / 1e3)


def gemm_rate(threads: int, n: int = 1024) -> float:
    """fp32 FLOP/s of an n x n x n matrix product, all threads."""
    torch.set_num_threads(threads)
    a, b = torch.rand(n, n), torch.rand(n, n)
    t = measure(lambda: a @ b, min_reps=10, min_seconds=0.5, max_seconds=3.0)
    return 2 * n ** 3 / (t["median_ms"] / 1e3)
