"""One engine over all workloads, in its own process so its peak memory is its own.

python -m benchmarks.worker SPEC.json  -> one JSON line per workload on stdout.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from models import AttentionConfig

from .engines import Engine, Unavailable, warm_check
from .timing import measure, peak_rss_mb, reset_peak_rss
from .workloads import Workload


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    config = AttentionConfig.from_dict(spec["config"])
    engine = Engine(spec["engine"], config, {k: Path(v) for k, v in spec["folders"].items()}, spec["threads"])
    why = spec.get("unavailable", {}).get(engine.name)  # an engine its preparation could not build here
    for raw in spec["workloads"]:
        w = Workload(**raw)
        row = {"engine": engine.name, "workload": w.name}
        try:
            if why:
                raise Unavailable(why)
            reset_peak_rss()
            warm_check(engine, w)
            row |= measure(engine.runner(w), **spec["timing"])
            row["peak_mb"] = peak_rss_mb()
            if (window := engine.window(w)) is not None:
                row["window"] = window
        except Unavailable as e:
            row["unavailable"] = str(e)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
