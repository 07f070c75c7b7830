"""Eager PyTorch's outputs that an export's checks hold its graphs to, computed while the model is in memory and
read back after it is gone.

An export first makes every graph (trace, passes, save) and every reference output with the eager model loaded, then
frees the model and checks the graphs in onnxruntime: the fp32 model (4 bytes a parameter) and onnxruntime's copy of
the graphs' weights are never held at once. A window's step cases hold caches (a 0.6B model's are 470 MB a case at
2048 rows), so they go to disk and are mapped back one (window, step) at a time.
"""
from __future__ import annotations

import ctypes
import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.parity import SequenceReference, StepCase


class EagerReferences:
    def __init__(self, folder: Path):
        """Spill files go to `folder` (inside the export's staging folder, so a killed export leaves nothing else
        behind), removed by close()."""
        self.folder = Path(folder)
        self.folder.mkdir()
        self._count: dict[tuple, int] = {}
        self.sequences: dict[tuple, SequenceReference] = {}  # window ladder -> the sequence check planned over it
        self.accuracy: list | None = None  # runtime/accuracy.references, for the quantized targets
        self.grid: dict[str, dict] = {}  # quantized target -> what its scheme's grid costs the model (grid_cost.py)

    def keep_prefix(self, caches: list[torch.Tensor]) -> None:
        """The cache rows of the random prefix every case starts from (runtime/parity.prefix_caches), on disk, a file
        per cache."""
        self._prefix_count = len(caches)
        for i, c in enumerate(caches):
            torch.save(c.clone(), self.folder / f"prefix.{i}.pt")  # clone: a view would save its whole storage

    def prefix(self) -> Iterator[torch.Tensor]:
        """Those rows, each cache mapped from disk in turn: a case copies one and drops it before the next is read, so
        at most one cache's rows (16 MB at 0.6B over 2048 rows) are resident, not all of them (440 MB)."""
        for i in range(self._prefix_count):
            yield torch.load(self.folder / f"prefix.{i}.pt", mmap=True)

    def add_case(self, window: int, step: str, case: StepCase) -> None:
        """One case at a time, on disk as soon as it is made: a 0.6B model's at 2048 rows is 0.5-1 GB."""
        self._count[window, step] = self._count.get((window, step), 0) + 1
        torch.save(case, self._path(window, step, self._count[window, step] - 1))

    def cases(self, window: int, step: str) -> Iterator[StepCase]:
        """The (window, step)'s cases, one at a time, their tensors mapped from disk (read as a check touches them)."""
        for i in range(self._count.get((window, step), 0)):
            yield torch.load(self._path(window, step, i), mmap=True, weights_only=False)

    def _path(self, window: int, step: str, i: int) -> Path:
        return self.folder / f"{step}.{window}.{i}.pt"

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# Under this many resident bytes there is nothing worth a full collection: once torch.export's objects are alive one
# costs 0.25 s, and a tiny model's export (440 MiB resident, unchanged by it) spent 15 s of its 84 s in 57 of them.
RELEASE_ABOVE = 1 << 30


def resident_bytes() -> int | None:
    """The process's resident set now (not its peak), or None where /proc does not tell."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_memory() -> None:
    """Hand freed memory back to the system: glibc keeps a freed model's pages in its heap, where they still count as
    the process's (a no-op where there is no malloc_trim). Skipped while the process is small (RELEASE_ABOVE)."""
    resident = resident_bytes()
    if resident is not None and resident < RELEASE_ABOVE:
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
