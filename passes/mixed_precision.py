"""Mixed precision in a QDQ graph: which activations may stay float, each for a named reason.

Mixed precision in a QDQ graph: which activations may stay float, each for a named reason, written by the quantizer
(export/quantize.py) into the graph's metadata and re-checked by lint on the graph it wrote; and how much of the graph's
weights stay float, bounded so that a graph labelled w8a16 holds 8-bit weights.

The reasons, one rule each:
- `range`: its calibrated range passes +-WIDE_RANGE. A trained model's residual stream carries massive activations
  (SmolLM2-135M: |x| ~ 25000 in a few channels of a few tokens, where every other value is ~3), so one 16-bit grid over
  it steps by 0.75 and every ordinary value carries that error (every activation quantized: KL 0.47 and 7.7 of 64 greedy
  tokens on real text). Past the bound, a 16-bit grid (with the calibration's margin) steps by more than 1/32: 3% of a
  unit-scale value. The norms ahead of every matmul divide those rows by their peak (passes/lower_npu.py), so what the
  matmuls read is bounded and stays 16-bit.
- `op`: made by one of FLOAT_OPS. Attention probabilities: QNN's HTP rounds a 16-bit Softmax's outputs down, and a long
  row's many small probabilities lose their mass (measured on SoC 43: one sink and 2075 other scores, the others' mass
  0.072 comes out 0.053 at 16 bits, 0.07201 in fp16). The norms' means of squares: their rows span 0.4..256, and a
  divisor's relative error is the output's (SmolLM2-135M's w8a16 first answer token flipped from 'The' to 'L').
- `rescaled`: made by one op from another float activation (not a product) and constants alone (Abs, ReduceMax, a Mul
  by 1/16, a Reshape; not a bounded op such as Softmax): it carries that activation's spread between rows in a smaller range (an
  RMSNorm's per-row scale: ~1600 in the massive rows, ~0.2 in the others), which one 16-bit grid resolves no better.
- `product`: a MatMul of two activations (the attention's Q K^T and P V): the HTP multiplies two 16-bit activations
  with several times the error of the QDQ graph's own arithmetic (SmolLM2-135M's decode step of its seventh answer
  token: scores rms 1.3e-2 there, 4.6e-3 on the CPU, and '.' came out ',' on SoC 43).

The matmuls beside a float activation keep float weights (QNN's HTP refuses a per-channel DequantizeLinear outside a
quantized group). MAX_FLOAT_WEIGHTS bounds their share: w8a16 names int8 weights, so a graph whose matmul weights are
mostly float (more than half their elements) is not w8a16, whatever its metadata says. The share is reported
(SmolLM2-135M: 5 of 210 matmuls; a 2-layer test model with one massive MLP: 2 of 15).
"""
from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from .analysis import const

WIDE_RANGE = 512.0
FLOAT_OPS = ("Softmax", "ReduceMean")
BOUNDED_OPS = ("Softmax", "Sigmoid")  # a range that is exact: not widened, and no rescale of a wide activation
MAX_FLOAT_WEIGHTS = 0.5
METADATA = "quantization.float_activations"  # a JSON object: {activation: its reason, as reasons() writes it}
WEIGHTED = {"MatMul": 1, "Gemm": 1, "Conv": 1}  # op -> which input is its weight


def reasons(model: ir.Model, ranges: dict[str, tuple]) -> dict[str, dict]:
    """{activation: why it stays float} for the float graph `model` (in topological order) given each activation's
    calibrated (low, high): the rules above, the first that applies."""
    found = {}
    for node in model.graph:
        dynamic = [v for v in node.inputs if v is not None and not _constant(v)]
        for out in node.outputs:
            low, high = ranges.get(out.name, (0.0, 0.0))
            low, high = float(np.min(low)), float(np.max(high))
            if max(-low, high) > WIDE_RANGE:
                found[out.name] = {"rule": "range", "range": [low, high]}
            elif node.op_type in FLOAT_OPS:
                found[out.name] = {"rule": "op", "op": node.op_type}
            elif len(dynamic) == 1 and _spreads(found.get(dynamic[0].name)) and node.op_type not in BOUNDED_OPS:
                found[out.name] = {"rule": "rescaled", "from": dynamic[0].name}
            elif node.op_type == "MatMul" and len(dynamic) == 2:
                found[out.name] = {"rule": "product"}
    return found


def declared(model: ir.Model) -> dict[str, dict]:
    """The activations a QDQ graph declares float, with their reasons ({} when it declares none)."""
    value = json.loads(model.metadata_props.get(METADATA, "{}"))
    return value if isinstance(value, dict) else dict.fromkeys(value, {})


def unjustified(model: ir.Model) -> list[tuple[str, str]]:
    """[(activation, why its declaration does not hold)] for each declared float activation of the QDQ graph `model`
    that it does not make, or whose reason the graph does not bear out."""
    producers = {o.name: n for n in model.graph.all_nodes() for o in n.outputs}
    found = declared(model)
    bad = []
    for name, reason in found.items():
        node, rule = producers.get(name), reason.get("rule")
        if node is None:
            bad.append((name, "no node of the graph makes it"))
            continue
        dynamic = [v.name for v in node.inputs if v is not None and not _constant(v)]
        if rule == "range":
            low, high = reason.get("range", (0.0, 0.0))
            ok, why = max(-low, high) > WIDE_RANGE, f"its calibrated range [{low:g}, {high:g}] is within +-{WIDE_RANGE:g}"
        elif rule == "op":
            ok, why = node.op_type == reason.get("op") and node.op_type in FLOAT_OPS, \
                f"made by {node.op_type}, not by one of {', '.join(FLOAT_OPS)} as declared ({reason.get('op')})"
        elif rule == "rescaled":
            src = reason.get("from")
            ok = dynamic == [src] and _spreads(found.get(src)) and node.op_type not in BOUNDED_OPS
            why = f"made by {node.op_type} from {dynamic}, not from the float activation {src} and constants alone"
        elif rule == "product":
            ok, why = node.op_type == "MatMul" and len(dynamic) == 2, \
                f"made by {node.op_type} from {len(dynamic)} activation(s), not a MatMul of two"
        else:
            ok, why = False, f"no reason given ({reason}); expected one of range, op, rescaled, product"
        if not ok:
            bad.append((name, why))
    return bad


def float_share(model: ir.Model) -> dict:
    """Of the graph's weighted matmuls (a constant weight, float or behind a DequantizeLinear): how many read a float
    weight, and the share of weight elements that are float."""
    total = floating = count = kept = 0
    for node in model.graph.all_nodes():
        i = WEIGHTED.get(node.op_type)
        w = node.inputs[i] if i is not None and len(node.inputs) > i else None
        if w is None or not _constant(w):
            continue
        stored = w if const(w) is not None else w.producer().inputs[0]  # a DequantizeLinear's output has no shape
        size = int(np.prod([d if isinstance(d, int) else 1 for d in stored.shape or ()]))
        total, count = total + size, count + 1
        if const(w) is not None:  # read as it is stored: float
            floating, kept = floating + size, kept + 1
    return {"matmuls": count, "float_matmuls": kept, "weights": total,
            "float_weights": floating / total if total else 0.0}


def _spreads(reason: dict | None) -> bool:
    """Whether an activation kept float for `reason` passes its spread on to what is rescaled from it: a wide one or
    a bounded op's does; a product of two activations does not (its next op's output is 16-bit again, so the output
    projection keeps its int8 weight)."""
    return reason is not None and reason.get("rule") != "product"


def _constant(v: ir.Value) -> bool:
    """A constant, or a DequantizeLinear of one (a quantized weight or table)."""
    p = v.producer()
    return const(v) is not None or (p is not None and p.op_type == "DequantizeLinear" and const(p.inputs[0]) is not None)
