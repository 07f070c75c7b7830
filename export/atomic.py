"""Writes that are all or nothing.

Every file of an export is first written into a staging folder beside its destination,
then renamed into place (a rename within one file system is atomic), the manifest last:
an interrupted or failed export leaves either the old files or the new ones, never a
half-written graph, and a folder it had to create is removed again.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


class OutputError(OSError):
    """The output folder cannot be written."""


@contextlib.contextmanager
def staging(out_dir: Path):
    """Yield a temp folder inside `out_dir`; `publish` moves its files into `out_dir` in the given order."""
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    except OSError as e:
        raise OutputError(f"output folder {out_dir}: cannot be written ({e.strerror}); expected a writable folder") from None
    try:
        yield tmp
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, out_dir: Path, names: list[str]) -> None:
    """Rename staged files into `out_dir`, each after its contents are on disk."""
    for name in names:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp / name, Path(out_dir) / name)


def write_json(path: Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
