"""python -m corpus: how many corpus graphs each rewriter fully fuses, as a markdown table.

Fully fused: no Softmax left, exactly one fused attention op (ONNX Attention, or
onnxruntime's GroupQueryAttention / MultiHeadAttention / Attention), and no repeat of
K/V heads in front of it. The public anchor is onnxscript's `optimize_for_ort` on the same
raw graph this project's pipelines start from.
"""
from __future__ import annotations

import collections
import sys

import onnx_ir as ir
from onnxscript.rewriter.ort_fusions import optimize_for_ort

from passes.leftovers import FUSED_OPS, unfused_attention
from runtime.cli import Parser
from passes.pipeline import run_pipeline

from . import cases, export_case


def fully_fused(model: ir.Model, reports: list[dict]) -> bool:
    ops = collections.Counter((n.domain, n.op_type) for n in model.graph)
    fused = sum(ops[k] for k in FUSED_OPS | {("com.microsoft", "Attention")})
    return ops[("", "Softmax")] == 0 and fused == 1 and not unfused_attention(model, reports)


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def measure(case) -> dict:
    raw = export_case(case)
    row = {}
    anchor = _copy(raw)
    try:
        optimize_for_ort(anchor)
        row["optimize_for_ort"] = fully_fused(anchor, [])
    except Exception as e:  # the anchor failing is a result, not our error
        row["optimize_for_ort"] = f"error: {type(e).__name__}"
    for target in ("onnx", "ort"):
        model = _copy(raw)
        report = run_pipeline(model, target)
        row[target] = fully_fused(model, report["passes"])
    return row


def table(rows: dict) -> str:
    mark = lambda v: "yes" if v is True else ("no" if v is False else v)  # noqa: E731
    lines = ["| graph | onnxscript `optimize_for_ort` | this project, `onnx` | this project, `ort` |", "|---|---|---|---|"]
    lines += [f"| {name} | {mark(r['optimize_for_ort'])} | {mark(r['onnx'])} | {mark(r['ort'])} |" for name, r in rows.items()]
    total = {k: sum(r[k] is True for r in rows.values()) for k in ("optimize_for_ort", "onnx", "ort")}
    n = len(rows)
    lines.append(f"| **fully fused** | **{total['optimize_for_ort']} / {n}** | **{total['onnx']} / {n}** | **{total['ort']} / {n}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    Parser(prog="python -m corpus", description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = {}
    for case in cases():
        rows[case.name] = measure(case)
        print(f"measured: {case.name}", file=sys.stderr)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
