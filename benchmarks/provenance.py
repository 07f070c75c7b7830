"""Where a result file's figures come from: commit, date, machine, command and the code it ran.

Where a result file's figures come from: its run's commit, date, machine and command, and a fingerprint of the code
the run executed, by which `python -m benchmarks.report` marks a figure measured before a change to that code stale.

The code a run depends on is every module of this repository it imported (its measuring workers' imports included),
each fingerprinted by its syntax tree without docstrings: a comment or a docstring changes no figure, a changed line
of code may. A result file keeps the stamp of every run whose rows it still holds (`runs`); it is stale when any of
them is, or when it records no stamp at all.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_MEASURING = ("benchmarks/report.py", "benchmarks/provenance.py")  # they render figures; they do not make them


def fingerprint(path: Path) -> str:
    """The module's code as its syntax tree, docstrings left out; '' when the file is gone or does not parse."""
    try:
        return _fingerprint(path.read_text())
    except (OSError, ValueError):
        return ""


@functools.lru_cache(maxsize=4096)
def _fingerprint(text: str) -> str:  # by content: a report renders ~30 stamps over the same ~70 modules
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


def imported(also: tuple[str, ...] = ()) -> list[str]:
    """This repository's modules imported by this process, after importing `also` (what its workers run)."""
    for name in also:
        importlib.import_module(name)
    files = {Path(f).resolve() for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}
    rel = sorted(str(f.relative_to(ROOT)) for f in files if f.is_relative_to(ROOT) and f.suffix == ".py")
    return [r for r in rel if not r.startswith((".venv", "tests/")) and r not in NOT_MEASURING]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def stamp(also: tuple[str, ...] = ()) -> dict:
    """This run's provenance: commit (with '+changes' when the tree differs from it), UTC date, machine, the command
    as typed (`python -m ...`), and the fingerprint of each module it imported."""
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    argv = getattr(sys, "orig_argv", sys.argv)
    command = shlex.join(["python", *argv[1:]])
    return {"commit": (_git("rev-parse", "--short=10", "HEAD") or "unknown") + ("+changes" if dirty else ""),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": {"cpu": cpu(), "cores": os.cpu_count()}, "command": command,
            "code": {path: fingerprint(ROOT / path) for path in imported(also)}}


def unchanged(start: dict) -> None:
    """Raise unless every module the run had imported when it started (`start`, its stamp then) is as it was: a module
    changed while the run measured would stamp its figures with code the run did not execute."""
    if moved := sorted(path for path, digest in start["code"].items() if fingerprint(ROOT / path) != digest):
        raise RuntimeError(f"the code changed while the run measured ({', '.join(moved)}); expected it unchanged: "
                           "rerun on the current code")


def runs(doc: dict) -> list[dict]:
    """The stamps of the runs whose figures a result file holds."""
    return doc.get("runs", [])


def keep(doc: dict, earlier: dict | None, run: dict) -> dict:
    """`doc` stamped with `run`, and with the stamps of `earlier` (the file it merges rows into) still in use."""
    held = [r for r in runs(earlier or {}) if r != run]
    return {**doc, "runs": [*held, run]}


def changed(doc: dict, root: Path = ROOT) -> list[str]:
    """Why the result file's figures are stale: each module whose code changed since a run measured them (or the
    file records no run at all); [] when they are current."""
    if not runs(doc):
        return ["no run recorded (measured before result files named their commit and code)"]
    return sorted({path for run in runs(doc) for path, digest in run["code"].items()
                   if fingerprint(root / path) != digest})


def describe(run: dict) -> str:
    """'commit abc, 2026-12-05 12:00 UTC, AMD EPYC (2 cores): `python -m benchmarks`'."""
    m = run["machine"]
    return f"commit {run['commit']}, {run['date']}, {m['cpu']} ({m['cores']} cores): `{run['command']}`"
