"""python -m benchmarks.profile ENGINE WORKLOAD...: where an onnxruntime engine's time goes, per op type.

Runs each workload the way the benchmark does (cache bound in place), with onnxruntime's
profiler on, and prints the kernel time per op type and per run. Uses the graphs the last
`make bench` exported (benchmarks/.work/).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

from models import preset
from runtime.cli import Parser, run

from .__main__ import model_configs
from .engines import Engine
from .workloads import FOLDER_MODELS, KINDS, ORT, QUANT, SINGLE, workloads

RUNS, SECONDS = 200, 10.0


def profile(engine: Engine, workload) -> str:
    run = engine.runner(workload)
    start = time.perf_counter()
    for _ in range(RUNS):
        run()
        if time.perf_counter() - start > SECONDS:
            break
    gen = engine._generator(workload.kind)
    session = (gen.prefill_session if workload.step == "prefill" else gen.decode_session).session
    trace = session.end_profiling()
    events = json.loads(Path(trace).read_text())
    os.remove(trace)
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    runs = sum(1 for e in events if e.get("name") == "model_run")
    total = sum(per_op.values())
    lines = [f"{engine.name} {workload.name}: {total / runs:.0f} us of kernel time per run (profiler on)", "",
             "| op | us per run | share |", "|---|---|---|"]
    lines += [f"| {op} | {t / runs:.0f} | {100 * t / total:.0f}% |" for op, t in per_op.most_common(8)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("engine", choices=ORT + SINGLE + QUANT)
    p.add_argument("workloads", nargs="+", help="e.g. decode@1024 prefill@0 block/decode@1024 lm/prefill@128 "
                   "smollm2/decode@1024")
    p.add_argument("--preset", default="minimind")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    return run(_profile_all, p.parse_args(argv))


def _profile_all(args) -> int:
    config = preset(args.preset)
    kinds = {name.split("/")[0] if "/" in name else "attention" for name in args.workloads}
    if unknown_kinds := sorted(kinds - set(KINDS)):
        raise ValueError(f"unknown workload kind(s) {unknown_kinds}: expected workloads of {', '.join(KINDS)}")
    configs = model_configs(config, [k for k in KINDS if k in kinds])
    known = {w.name: w for w in workloads(configs, quick=False)}
    unknown = [w for w in args.workloads if w not in known]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}: expected some of {', '.join(known)}")
    for name in args.workloads:
        w = known[name]
        folder = Path("benchmarks/.work") / (w.kind if w.kind in FOLDER_MODELS else f"{args.preset}-{w.kind}")
        engine = Engine(args.engine, configs[w.kind], {w.kind: folder}, args.threads, profile=True)
        print(profile(engine, w) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
