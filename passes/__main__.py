"""python -m passes IN.onnx OUT.onnx --target TARGET: rewrite one ONNX file for a target (registry.py names them)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx_ir as ir

import registry
from runtime.cli import Parser, run
from runtime.metrics import Budget

from .fix_dims import FixDimsError, check_pins, parse_pins
from .leftovers import FUSED_OPS, unfused_attention
from .model_io import check_writable, load, save_atomic
from .pipeline import run_pipeline
from .verify import compare, run_check


def _pins(text: str) -> dict[str, int]:
    try:
        return parse_pins(text)
    except FixDimsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m passes",
        description="Run a target's pass pipeline on an ONNX file: " + "; ".join(
            f"{t} ({registry.target(t).what})" for t in registry.pipeline_targets()) + ". "
                    "Prints one statistics line per pass. The input is never modified; the output is written "
                    "atomically, only once it loads and runs in onnxruntime, and not at all when a check below fails.")
    p.add_argument("input", help="ONNX file to rewrite")
    p.add_argument("output", help="where to write the rewritten graph")
    p.add_argument("--target", required=True, choices=registry.pipeline_targets(),
                   help="what the attention becomes (a quantized target also quantizes the linear layers' weights)")
    p.add_argument("--fix-dims", type=_pins, default={}, metavar="NAME=VALUE|INPUT.AXIS=VALUE,...",
                   help="pin symbolic dims by name (e.g. batch_size=1,sequence_length=128); names that say batch, "
                        "sequence, past or total length get defaults (1, 128, 128, past + sequence), reported. A dim "
                        "the graph left unnamed ([1, None]) is pinned by input name and axis: input_ids.1=16 (dim "
                        "names never contain a dot, so a key with one is INPUT.AXIS, split at its last dot); a dim "
                        "left dynamic is reported by fix_dims with the exact flag that pins it")
    p.add_argument("--report", metavar="FILE.json", help="write per-pass statistics, matches and non-matches (with why)")
    p.add_argument("--require-fusion", action="store_true",
                   help="fail when an attention-shaped subgraph (Softmax between two MatMuls) or a K/V repeat is left")
    p.add_argument("--verify", action="store_true",
                   help="run the graph before and after in onnxruntime on random feeds; fail past tolerance (1e-4 "
                        "relative in fp32; ort-int4/ort-int8: the scheme's budget, export/quantize.py)")
    p.add_argument("--no-run-check", action="store_true",
                   help="write the graph without first checking that it loads and runs in onnxruntime (huge graphs)")
    p.add_argument("--dump-dir", metavar="DIR", help="save the graph after every pass into DIR (NN-pass.onnx)")
    return p


def main(argv=None) -> int:
    return run(rewrite, parser().parse_args(argv))


def rewrite(args) -> int:
    if args.verify and registry.target(args.target).cache == registry.HOST:
        keeps = [t for t in registry.pipeline_targets() if registry.target(t).cache == registry.GRAPH]
        raise ValueError(f"--verify runs the graph before and after on the same feeds, but the {args.target} target "
                         "changes the step's inputs and outputs (its cache is the host's); expected a target whose "
                         f"graph keeps its cache, {'/'.join(keeps)} (make export checks host-cache graphs against eager "
                         "PyTorch through the host-cache driver)")
    check_writable(args.output)
    if args.report:
        check_writable(args.report, "report")
    model = load(args.input)
    check_pins(model, args.fix_dims)
    report = run_pipeline(model, args.target, dump_dir=args.dump_dir, log=print, fix_dims=args.fix_dims)
    report.update(input=str(args.input), output=str(args.output))
    failures = []
    report["unfused"] = _unfused(model, report["passes"], args.target)
    host = registry.target(args.target).cache == registry.HOST
    report["fused_ops"] = sum((n.domain, n.op_type) in FUSED_OPS for n in model.graph) if not host \
        else _lowered(report["passes"])
    for left in report["unfused"]:
        print(f"unfused: {left['op']} {left['node']}: {left['reason']}")
    for kept in (n for p in report["passes"] if p["pass"] == "lower_gqa" for n in p["not_matched"]):
        print(f"not lowered: {kept['op']} {kept['node']} stays a standard Attention: {kept['reason']}")
    if not report["fused_ops"] and not report["unfused"]:
        print("nothing to fuse: no attention (Softmax between two MatMuls) in the graph")
    if args.require_fusion and report["unfused"]:
        failures.append(f"{len(report['unfused'])} attention subgraph(s) left unfused (--require-fusion)")
    elif args.require_fusion and not report["fused_ops"]:
        failures.append("no attention to fuse in the graph (--require-fusion)")
    data = ir.serde.serialize_model(model).SerializeToString()
    if not args.no_run_check and (broken := run_check(data, str(args.input))):
        failures.append(broken)
    elif args.verify:
        results = compare(str(args.input), data, budget=_budget(args.target))
        report["verify"] = results
        print("verify: " + ", ".join(f"{k} max abs {r['max_abs']:.1e}, rel {r['max_rel']:.1e}" for k, r in results.items()))
        if bad := [f"{k} {r['why']}" for k, r in results.items() if not r["ok"]]:
            failures.append(f"verify against the graph before the passes: {'; '.join(bad)}")
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    if failures:
        print(f"error: {'; '.join(failures)}; {args.output} not written", file=sys.stderr)
        return 1
    save_atomic(model, args.output)
    print(f"wrote {args.output}")
    return 0


def _budget(target: str):
    """A quantized target's outputs are held to its scheme's step budget, the rule's cap (a graph alone: no eager model
    to measure the grid's cost on); float targets' to their dtype's tolerance (passes/verify.py)."""
    if registry.target(target).scheme is None:
        return None
    return Budget(registry.GRID_RULE.cap.max_rel)


def _lowered(reports: list[dict]) -> int:
    return sum(p["stats"].get("attention", 0) for p in reports if p["pass"] == "lower_npu")


def _unfused(model: ir.Model, reports: list[dict], target: str) -> list[dict]:
    """What is left unfused; for a host-cache target, a graph the lowering refused is left whole, with the reason."""
    if registry.target(target).cache != registry.HOST:
        return unfused_attention(model, reports)
    if _lowered(reports):
        return []
    if not any((n.domain, n.op_type) in FUSED_OPS for n in model.graph) and not unfused_attention(model, reports):
        return []  # no attention at all
    lower = next(p for p in reports if p["pass"] == "lower_npu")
    return [{"node": n["node"], "op": "lower_npu", "reason": f"not lowered to the npu form: {n['reason']}"}
            for n in lower["not_matched"]]

if __name__ == "__main__":
    sys.exit(main())
