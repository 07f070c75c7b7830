"""python -m passes.lint FILE.onnx --profile {static,static-qdq,standard,contrib,TARGET} [--json]: what a toolchain
will reject. A target's name (registry.py) picks the profile its graphs are held to.

Each profile is a list of rules; every violation is printed with the rule, node and op,
and the exit status is 1 if there is any. `static` is what NPU compilers (QNN, OpenVINO NPU,
Vitis AI) accept: opset 17, static shapes, no control flow, no shape-computing, scatter
(QNN's HTP has none) or repeat ops, no computed Reshape, int32 integer inputs, no boolean
inputs (QNN refuses a boolean attention mask: it wants an additive float one), no
infinities. A quantized (QDQ) graph also keeps what QNN, OpenVINO and Vitis AI state for
QDQ models: 16-bit activations at opset 21 (where 16-bit QuantizeLinear is standard; 17
otherwise), MatMul/Gemm/Conv weights int8 with zero point 0 and positive scales behind a
DequantizeLinear (symmetric weights), every compute op between DequantizeLinear and
QuantizeLinear (no float islands, which the HTP would run in fp16 or refuse), but for the
activations the graph declares float (mixed precision, a note), each for a reason lint re-checks on the graph
(passes/mixed_precision.py), whose matmuls keep float weights (QNN refuses a per-channel DequantizeLinear outside a
quantized group). The `static-qdq` profile, a quantized target's, also wants the graph quantized: Q/DQ present and at
most passes.mixed_precision.MAX_FLOAT_WEIGHTS of its matmul weights float. `standard` and
`contrib` check what their targets promise: static shapes and every
attention fused, without a K/V repeat; `standard` also standard domains only at opset 24.

Notes are what a toolchain needs told rather than errors, printed without failing: on the
npu profile, a float table gathered by integer positions (RoPE's cos/sin) compiles for
QNN's HTP only with fp16 precision on (`enable_htp_fp16_precision=1`), so an fp32 graph runs
there in fp16; so do a QDQ graph's declared float activations.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

import registry
from runtime.cli import Parser, run

from .analysis import const
from .leftovers import unfused_attention
from .mixed_precision import MAX_FLOAT_WEIGHTS, WEIGHTED, declared, float_share, unjustified
from .model_io import load
from .static_shapes import unknown_dims

CONTROL_FLOW = {"If", "Loop", "Scan"}
SHAPE_OPS = {"Shape", "Size", "Range", "ConstantOfShape", "NonZero"}
SCATTER_OPS = {"ScatterND", "ScatterElements", "Scatter", "TensorScatter"}
REPEAT_OPS = {"Expand", "Tile"}


@dataclass
class Violation:
    rule: str
    node: str
    op: str
    message: str


def _nodes(model: ir.Model):
    return list(model.graph.all_nodes())


def opset(version: int):
    def rule(model, path):
        got = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        return [] if got == version else [Violation("opset", "", "", f"default-domain opset {got}; expected {version}")]
    rule.__name__ = f"opset_{version}"
    return rule


def npu_opset(model, path):
    """17; 21 for a QDQ graph with 16-bit activations (QuantizeLinear to int16/uint16 is standard from opset 21)."""
    wide = any(n.op_type == "QuantizeLinear" and len(n.inputs) > 2 and n.inputs[2] is not None
               and n.inputs[2].dtype in (ir.DataType.UINT16, ir.DataType.INT16) for n in _nodes(model))
    return opset(21 if wide else 17)(model, path)


QDQ = {"QuantizeLinear", "DequantizeLinear"}
MOVES = {"Reshape", "Transpose", "Concat", "Slice", "Split", "Squeeze", "Unsqueeze", "Gather", "Identity"}


def qdq_weights(model, path):
    """In a QDQ graph, the weight of a MatMul/Gemm/Conv is an int8 constant with zero point 0 and positive scales behind
    a DequantizeLinear (symmetric weights, what QNN, OpenVINO and Vitis AI take per channel); other constants (norm
    weights, tables) are quantized like activations. A matmul that reads or writes an activation the graph declares
    float keeps a float weight: QNN's HTP refuses a per-channel DequantizeLinear outside a quantized group."""
    if not any(n.op_type in QDQ for n in _nodes(model)):
        return []
    found, declared = [], float_activations(model)
    for n in (n for n in _nodes(model) if n.op_type in WEIGHTED and len(n.inputs) > WEIGHTED[n.op_type]):
        w = n.inputs[WEIGHTED[n.op_type]]
        dq = w.producer() if w is not None else None
        beside = next((v.name for v in (*n.inputs, *n.outputs) if v is not None and v.name in declared), None)
        if beside is not None:
            if dq is not None and dq.op_type == "DequantizeLinear" and const(dq.inputs[0]) is not None:
                found.append(Violation("qdq-weights", n.name, n.op_type, f"weight {dq.inputs[0].name} is quantized "
                                       f"beside the float activation {beside}; expected a float weight (QNN's HTP "
                                       "refuses a per-channel DequantizeLinear outside a quantized group)"))
            continue
        if dq is None or dq.op_type != "DequantizeLinear" or const(dq.inputs[0]) is None:
            if w is not None and const(w) is not None:
                found.append(Violation("qdq-weights", n.name, n.op_type, f"weight {w.name} is float; expected int8 "
                                       "behind a DequantizeLinear"))
            continue
        zero = const(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] is not None else np.zeros(1)
        scale = const(dq.inputs[1])
        if dq.inputs[0].dtype != ir.DataType.INT8 or zero is None or zero.any():
            found.append(Violation("qdq-weights", n.name, n.op_type, f"weight {dq.inputs[0].name} is "
                                   f"{dq.inputs[0].dtype} with zero point {zero}; expected int8, symmetric"))
        if scale is None or not (np.isfinite(scale).all() and (scale > 0).all()):
            found.append(Violation("qdq-weights", n.name, n.op_type, f"scale {dq.inputs[1].name}: expected finite and "
                                   "positive"))
    return found


def float_activations(model) -> set[str]:
    """The activations a QDQ graph declares float (mixed precision; passes/mixed_precision.py)."""
    return set(declared(model))


def float_justified(model, path):
    """Each activation a QDQ graph declares float is made by the graph, for the reason it gives, re-checked
    (passes/mixed_precision.py): a declaration is not a licence."""
    return [Violation("float-justified", name, "", f"declared float: {why}") for name, why in unjustified(model)]


def qdq_present(model, path):
    """A graph whose target is quantized holds Q/DQ pairs, and at most MAX_FLOAT_WEIGHTS of its matmul weights (by
    elements) stay float: a graph that is mostly float is not w8a16."""
    if not any(n.op_type in QDQ for n in _nodes(model)):
        return [Violation("qdq-present", "", "", "no QuantizeLinear or DequantizeLinear; expected a QDQ graph")]
    share = float_share(model)
    if share["float_weights"] > MAX_FLOAT_WEIGHTS:
        return [Violation("qdq-present", "", "", f"{share['float_weights']:.1%} of matmul weights float "
                          f"({share['float_matmuls']} of {share['matmuls']} matmuls); expected at most "
                          f"{MAX_FLOAT_WEIGHTS:.0%} (a graph whose weights are mostly float is not w8a16)")]
    return []


def qdq_complete(model, path):
    """In a QDQ graph, every compute op reads activations from DequantizeLinear and writes them through QuantizeLinear,
    but for the activations the graph declares float."""
    if not any(n.op_type in QDQ for n in _nodes(model)):
        return []
    outputs, declared = {id(v) for v in model.graph.outputs}, float_activations(model)
    found = []
    for n in _nodes(model):
        if n.op_type in QDQ or n.op_type in MOVES:
            continue
        floats = [v for v in n.inputs if v is not None and v.dtype == ir.DataType.FLOAT and const(v) is None
                  and v.name not in declared]
        bad_in = [v.name for v in floats if v.producer() is None or v.producer().op_type != "DequantizeLinear"]
        bad_out = [v.name for v in n.outputs if v.dtype == ir.DataType.FLOAT and id(v) not in outputs
                   and v.name not in declared and not any(u.op_type == "QuantizeLinear" for u, _ in v.uses())]
        if bad_in or bad_out:
            found.append(Violation("qdq-complete", n.name, n.op_type, f"float {'input' if bad_in else 'output'} "
                                   f"{(bad_in or bad_out)[0]} is not quantized; expected DequantizeLinear -> op -> "
                                   "QuantizeLinear"))
    return found


def static_shapes(model, path):
    strict = all(n.domain in ("", "ai.onnx") for n in _nodes(model)) and \
        not any(n.op_type == "SimplifiedLayerNormalization" for n in _nodes(model))
    bad, _ = unknown_dims(path, strict=strict)
    return [Violation("static-shape", name.split(":")[0], "", f"{name}; expected fixed positive dims") for name in bad]


def forbidden(rule_name: str, ops: set[str]):
    def rule(model, path):
        return [Violation(rule_name, n.name, n.op_type, f"{n.op_type} is not accepted by this profile")
                for n in _nodes(model) if n.op_type in ops]
    rule.__name__ = rule_name
    return rule


def computed_reshape(model, path):
    return [Violation("computed-reshape", n.name, n.op_type, f"Reshape to a shape computed at run time ({n.inputs[1].name})")
            for n in _nodes(model) if n.op_type == "Reshape" and const(n.inputs[1]) is None]


def no_bool_inputs(model, path):
    return [Violation("no-bool-inputs", v.name, "input", f"input {v.name} is boolean; QNN's HTP refuses a boolean "
                      "attention mask, expected an additive float one")
            for v in model.graph.inputs if v.dtype == ir.DataType.BOOL]


def int32_inputs(model, path):
    ints = {ir.DataType.INT64, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT64, ir.DataType.UINT32}
    return [Violation("int32-inputs", v.name, "input", f"input {v.name} is {v.dtype}; expected int32 for integers")
            for v in model.graph.inputs if v.dtype in ints]


def finite_constants(model, path):
    found = []
    values = list(model.graph.initializers.values()) + [o for n in _nodes(model) if n.op_type == "Constant" for o in n.outputs]
    for v in values:
        if not _finite(v):
            found.append(Violation("finite-constants", v.name, "constant", f"{v.name} holds inf or NaN; expected finite values"))
    return found


def _finite(value: ir.Value) -> bool:
    """No inf or NaN in the value's constant (if it is one). A weight mapped from its file (load(map_weights=True)) is
    unmapped once read, so a whole model's weights are never resident at once."""
    array = const(value)
    finite = array is None or array.dtype.kind != "f" or bool(np.isfinite(array).all())
    del array  # the mapping cannot close while an array reads it
    if isinstance(value.const_value, ir.ExternalTensor):
        value.const_value.release()
    return finite


def standard_domains(model, path):
    return [Violation("standard-domain", n.name, n.op_type, f"{n.domain}.{n.op_type} is not a standard ONNX op")
            for n in _nodes(model) if n.domain not in ("", "ai.onnx")]


def attention_fused(model, path):
    left = unfused_attention(model, [], unreported="a Softmax between two MatMuls, not fused into an attention op")
    return [Violation("attention-fused", x["node"], x["op"], x["reason"]) for x in left]


def fp32_tables(model, path):
    """Gathers from fp32 constant tables by a graph input's integer positions: fp16 on QNN's HTP."""
    inputs = {id(v) for v in model.graph.inputs}
    return [Violation("qnn-fp16-precision", n.name, n.op_type, f"fp32 table {n.inputs[0].name} gathered by input "
                      f"{n.inputs[1].name}: QNN's HTP compiles this only with enable_htp_fp16_precision=1 (fp16)")
            for n in _nodes(model) if n.op_type == "Gather" and const(n.inputs[0]) is not None
            and n.inputs[0].dtype == ir.DataType.FLOAT and id(n.inputs[1]) in inputs]


def mixed_precision(model, path):
    """A QDQ graph's declared float activations: fp16 on QNN's HTP."""
    declared = float_activations(model)
    return [Violation("qnn-fp16-precision", "", "", f"{len(declared)} activation(s) kept float (mixed precision, "
                      f"e.g. {min(declared)}): QNN's HTP runs them only with enable_htp_fp16_precision=1 (fp16)")
            ] if declared else []


NPU = [npu_opset, static_shapes, forbidden("control-flow", CONTROL_FLOW), forbidden("shape-op", SHAPE_OPS),
       forbidden("scatter", SCATTER_OPS), forbidden("repeat", REPEAT_OPS), computed_reshape, int32_inputs,
       no_bool_inputs, finite_constants, standard_domains, qdq_weights, qdq_complete, float_justified]
PROFILES = {
    "static": NPU,
    "static-qdq": NPU + [qdq_present],  # a quantized host-cache target's graph
    "standard": [opset(24), static_shapes, standard_domains, attention_fused],
    "contrib": [static_shapes, attention_fused],
}


NOTES = {"static": [fp32_tables, mixed_precision], "static-qdq": [fp32_tables, mixed_precision], "standard": [],
         "contrib": []}


def profile_of(name: str) -> str:
    """A profile's name, or the profile a target's graphs are held to (registry.py)."""
    if name in PROFILES:
        return name
    if name in registry.TARGETS and registry.target(name).lint:
        return registry.target(name).lint
    held = [t for t, e in registry.TARGETS.items() if e.lint]
    raise ValueError(f"unknown profile {name!r}: expected one of {', '.join(PROFILES)} or a target ({', '.join(held)})")


def lint(path: str | Path, profile: str, notes: bool = False) -> list[Violation]:
    """The profile's violations (with `notes`, its notes instead); a target's name picks its profile."""
    profile = profile_of(profile)
    model = load(path, map_weights=True)  # read whole, a model's weights took 3x their size (onnx.load, the checker)
    return [v for rule in (NOTES if notes else PROFILES)[profile] for v in rule(model, path)]


def main(argv=None) -> int:
    p = Parser(prog="python -m passes.lint", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="ONNX file to check")
    p.add_argument("--profile", required=True, type=_profile, metavar="PROFILE|TARGET",
                   help=f"which toolchain's rules: {', '.join(PROFILES)}, or a target's name for its profile")
    p.add_argument("--json", metavar="FILE", help="also write the violations as JSON")
    return run(_report, p.parse_args(argv), status=2)


def _profile(name: str) -> str:
    try:
        return profile_of(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _report(args) -> int:
    found, notes = lint(args.file, args.profile), lint(args.file, args.profile, notes=True)
    for v in found:
        print(f"{v.rule}: {v.node or '-'} ({v.op or '-'}): {v.message}")
    for v in notes:
        print(f"note: {v.rule}: {v.node or '-'} ({v.op or '-'}): {v.message}")
    print(f"{args.file}: {len(found)} violation(s) of profile {args.profile}" + (f", {len(notes)} note(s)" if notes else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"file": str(args.file), "profile": args.profile,
                                               "violations": [asdict(v) for v in found],
                                               "notes": [asdict(v) for v in notes]}, indent=2) + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
