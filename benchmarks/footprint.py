"""python -m benchmarks.footprint: what a user's disk holds after each step of the README, measured.

The virtual environment `make setup` installs (.venv), the trained model `make smollm2` fetches (artifacts/smollm2),
and its export over the default window ladder with every target (artifacts/smollm2-lm, or the benchmark's export of
it, which also holds the quantized targets): their sizes in bytes, with the Python that ran the setup. Writes
benchmarks/footprint.json; the README's requirements are generated from it. A folder that is not there is reported
absent, not guessed.
"""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

from runtime.cli import Parser, run

from . import provenance

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"setup": ".venv", "trained model": "artifacts/smollm2", "its export": "artifacts/smollm2-lm"}
OUT = ROOT / "benchmarks" / "footprint.json"


def size(path: Path) -> int | None:
    """Bytes of every file under `path` (links not followed), or None when it is absent."""
    if not path.exists():
        return None
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.footprint", description=__doc__.split("\n\n")[0])
    return run(lambda _: measure(), p.parse_args(argv))


def measure() -> int:
    sizes = {what: size(ROOT / folder) for what, folder in FOLDERS.items()}
    doc = {"python": platform.python_version(), "folders": FOLDERS, "bytes": sizes,
           "runs": [provenance.stamp()]}
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: " + ", ".join(f"{w} {'absent' if b is None else f'{b / 1e9:.2f} GB'}"
                                                         for w, b in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
