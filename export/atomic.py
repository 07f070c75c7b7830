"""Writes that are all or nothing.

An export is built in a staging folder beside its destination and swapped into place
whole, after every file is on disk: a failed, interrupted or killed export leaves the
previous folder (or none) and at most a hidden staging folder, which the next export
removes once the process that made it is gone.
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
def staged_dir(out: Path):
    """Yield an empty folder beside `out`; when the block succeeds it replaces `out` whole."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"output folder {out}: cannot be written ({e.strerror}); expected a writable folder") from None
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(new: Path, out: Path) -> None:
    """Swap `new` into `out`'s place; the old folder moves aside first and is removed only after."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


def _remove_orphans(out: Path) -> None:
    """Staging or set-aside folders of `out` whose process no longer runs (killed mid-export)."""
    for path in out.parent.glob(f".{out.name}.*-*"):
        try:
            pid = int(path.name.split("-")[1]) if ".staging-" in path.name else int(path.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def write_json(path: Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
