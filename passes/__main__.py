"""python -m passes IN.onnx OUT.onnx --target {raw,onnx,ort}: rewrite one ONNX file for a target."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx_ir as ir

from runtime.cli import Parser, run

from .leftovers import FUSED_OPS, unfused_attention
from .model_io import load, save_atomic
from .pipeline import TARGETS, run_pipeline
from .verify import compare


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m passes",
        description="Run a target's pass pipeline on an ONNX file: raw (cleanup only), onnx (standard opset-24 "
                    "Attention, TensorScatter, RMSNormalization), ort (onnxruntime GroupQueryAttention, "
                    "SimplifiedLayerNormalization), npu (opset-17 static primitives, host-owned cache and mask). "
                    "Prints one statistics line per pass. The input is never "
                    "modified; the output is written atomically, and not at all when a check below fails.")
    p.add_argument("input", help="ONNX file to rewrite")
    p.add_argument("output", help="where to write the rewritten graph")
    p.add_argument("--target", required=True, choices=TARGETS, help="what the attention becomes")
    p.add_argument("--report", metavar="FILE.json", help="write per-pass statistics, matches and non-matches (with why)")
    p.add_argument("--require-fusion", action="store_true",
                   help="fail when an attention-shaped subgraph (Softmax between two MatMuls) or a K/V repeat is left")
    p.add_argument("--verify", action="store_true",
                   help="run the graph before and after in onnxruntime on random feeds; fail past tolerance")
    p.add_argument("--dump-dir", metavar="DIR", help="save the graph after every pass into DIR (NN-pass.onnx)")
    return p


def main(argv=None) -> int:
    return run(rewrite, parser().parse_args(argv))


def rewrite(args) -> int:
    if args.verify and args.target == "npu":
        raise ValueError("--verify runs the graph before and after on the same feeds, but the npu target changes the "
                         "step's inputs and outputs; expected --target raw/onnx/ort (make export checks npu graphs "
                         "against eager PyTorch through the host-cache driver)")
    model = load(args.input)
    report = run_pipeline(model, args.target, dump_dir=args.dump_dir, log=print)
    report.update(input=str(args.input), output=str(args.output))
    failures = []
    lowered = sum(p["stats"].get("attention", 0) for p in report["passes"] if p["pass"] == "lower_npu")
    report["unfused"] = [] if args.target == "npu" else unfused_attention(model, report["passes"])
    report["fused_ops"] = lowered or sum((n.domain, n.op_type) in FUSED_OPS for n in model.graph)
    for left in report["unfused"]:
        print(f"unfused: {left['op']} {left['node']}: {left['reason']}")
    if not report["fused_ops"] and not report["unfused"]:
        print("nothing to fuse: no attention (Softmax between two MatMuls) in the graph")
    if args.require_fusion and report["unfused"]:
        failures.append(f"{len(report['unfused'])} attention subgraph(s) left unfused (--require-fusion)")
    elif args.require_fusion and not report["fused_ops"]:
        failures.append("no attention to fuse in the graph (--require-fusion)")
    if args.verify:
        results = compare(str(args.input), ir.serde.serialize_model(model).SerializeToString())
        report["verify"] = results
        worst = max(results.values(), key=lambda r: r["max_rel"], default=None)
        print("verify: " + ", ".join(f"{k} max abs {r['max_abs']:.1e}" for k, r in results.items()))
        bad = [k for k, r in results.items() if not r["ok"]]
        if bad:
            failures.append(f"verify: {bad} differ past tolerance ({worst['max_abs']:.1e})")
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    if failures:
        print(f"error: {'; '.join(failures)}; {args.output} not written", file=sys.stderr)
        return 1
    save_atomic(model, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
