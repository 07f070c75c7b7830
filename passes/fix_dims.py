"""fix_dims: pin the graph inputs' symbolic dims by name, so a graph from a dynamic exporter becomes static.

A dim the graph left unnamed (onnxscript's `INT64[1, None]`) has no name to pin: it is pinned by input and axis,
`--fix-dims input_ids.1=16`. Dim names are identifiers, so a key with a dot is always INPUT.AXIS (split at the
last dot). A dim left dynamic is reported with the exact flag that would pin it.

Exporters write symbolic dims (`batch_size`, `sequence_length`, Optimum's
`past_sequence_length + 1`, torch's `s0`); the fusions need numbers. Each name is pinned to
the value asked for (`--fix-dims NAME=VALUE,...`) or, for names that say what they are, a
default, and the report says which: batch -> 1, past/cache length -> 128, sequence/length/
tokens -> 128, total -> past + sequence. A dim written as an expression of names is
evaluated. Then every other tensor's shape is inferred again and the shape arithmetic of
TorchScript-era graphs (Shape/Gather/Concat/ConstantOfShape/Where into a Reshape or Expand)
is evaluated in onnxruntime and replaced by constants, round by round, until every shape
that follows from the pinned dims is known.
"""
from __future__ import annotations

import ast
import operator
import re

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from .analysis import attr, evaluate, static_shape
from .base import GraphPass
from .build import Builder, replace_value

BATCH, SEQUENCE, PAST = 1, 128, 128
FOLD_ELEMENTS = 1 << 16  # values computed from constants alone, up to this size, become constants
ROUNDS = 8
RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv}


class FixDimsError(ValueError):
    """A --fix-dims request that does not fit the graph."""


def names(model: ir.Model) -> list[str]:
    """The names the graph inputs' symbolic dims are written in, in order of appearance."""
    found = {}
    for v in model.graph.inputs:
        for d in (v.shape or ()):
            if isinstance(d, ir.SymbolicDim) and d.value:
                found.update(dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", d.value)))
    return list(found)


def parse_pins(text: str) -> dict[str, int]:
    """'batch=1,seq=128,input_ids.1=16' -> {'batch': 1, 'seq': 128, 'input_ids.1': 16}.

    A key with a dot pins one dim of one input by position, INPUT.AXIS (split at the last dot, so an input
    named `input.1` is `input.1.0`): the way to pin a dim the graph left unnamed (`[1, None]`). Dim names
    are identifiers (see `names`), so the two kinds of key cannot be confused."""
    pins = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not name or not re.fullmatch(r"[+-]?\d+", value):
            raise FixDimsError(f"--fix-dims {item!r}: expected NAME=VALUE or INPUT.AXIS=VALUE with a positive "
                               "integer VALUE")
        if int(value) <= 0:
            raise FixDimsError(f"--fix-dims {item!r}: VALUE must be a positive integer, got {int(value)}")
        if "." in name:
            source, _, axis = name.rpartition(".")
            if not source or not axis.isdigit():
                raise FixDimsError(f"--fix-dims {item!r}: expected INPUT.AXIS=VALUE with AXIS a non-negative "
                                   "integer (a dim name has no dot)")
            name = f"{source}.{int(axis)}"
        if pins.get(name, int(value)) != int(value):
            raise FixDimsError(f"--fix-dims {name}: pinned twice, to {pins[name]} and {int(value)}")
        pins[name] = int(value)
    return pins


def axis_pins(model: ir.Model, pins: dict[str, int]) -> dict[tuple[str, int], int]:
    """The INPUT.AXIS pins, checked against the graph: {(input, axis): value}. Only an unnamed dynamic dim, or a
    static one of the same value, can be pinned by position; a named dim is pinned by its name."""
    inputs = {v.name: v for v in model.graph.inputs}
    out = {}
    for key, value in pins.items():
        if "." not in key:
            continue
        source, _, axis = key.rpartition(".")
        axis, flag = int(axis), f"--fix-dims {key}={value}"
        if source not in inputs:
            raise FixDimsError(f"{flag}: the graph has no input named {source!r}; its inputs are {list(inputs)}")
        shape = inputs[source].shape
        if shape is None:
            raise FixDimsError(f"{flag}: input {source!r} declares no shape, so it has no axis {axis} to pin")
        if axis >= len(shape):
            raise FixDimsError(f"{flag}: axis {axis} is out of range for input {source!r} of rank {len(shape)} "
                               f"(shape {_shape(shape)}, axes 0..{len(shape) - 1})")
        d = shape[axis]
        if isinstance(d, int):
            if d != value:
                raise FixDimsError(f"{flag}: axis {axis} of input {source!r} is already static, {d} (shape "
                                   f"{_shape(shape)}); only a dynamic dim can be pinned")
            continue
        if d.value:
            raise FixDimsError(f"{flag}: axis {axis} of input {source!r} is the named dim {d.value!r}; pin it by "
                               f"name: --fix-dims {_by_name(d.value, value)}")
        out[(source, axis)] = value
    return out


def check_pins(model: ir.Model, pins: dict[str, int]) -> None:
    """Every pinned name must be a symbolic dim of the graph, every INPUT.AXIS an unnamed dynamic dim of an input."""
    known = names(model)
    unknown = [n for n in pins if "." not in n and n not in known]
    if unknown:
        hint = _unnamed_hint(model) or ("" if known else " (it is static)")
        raise FixDimsError(f"--fix-dims {', '.join(unknown)}: no input dim has that name; "
                           f"the graph's symbolic dims are {known or 'none'}{hint}")
    axis_pins(model, pins)


def _by_name(expr: str, value: int) -> str:
    """The NAME=VALUE pins for a named dim: its own value for a plain name, VALUE for each name of an expression."""
    found = _names(expr)
    return f"{expr}={value}" if found == [expr] else ",".join(f"{n}=VALUE" for n in found)


def _names(expr: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)))


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else repr(d.value) if d.value else "None" for d in shape) + "]"


def _unnamed_hint(model: ir.Model) -> str:
    unnamed = [f"{v.name}.{i}" for v in model.graph.inputs for i, d in enumerate(v.shape or ())
               if isinstance(d, ir.SymbolicDim) and not d.value]
    flag = ",".join(f"{u}=VALUE" for u in unnamed)
    return f"; its unnamed dynamic dims are pinned by input and axis: --fix-dims {flag}" if unnamed else ""


def default(name: str, all_names: list[str]) -> int | None:
    n = name.lower()
    if "batch" in n or n in ("b", "n", "bs"):
        return BATCH
    if "past" in n or "cache" in n:
        return PAST
    if "total" in n:
        return SEQUENCE + (PAST if any("past" in x.lower() or "cache" in x.lower() for x in all_names) else 0)
    if "seq" in n or "len" in n or "token" in n or n in ("t", "s", "l"):
        return SEQUENCE
    return None


def dim_value(expr: str, values: dict[str, int]) -> int | None:
    """An integer dim expression over named values (+, -, *, //), or None if it names an unpinned value."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return values.get(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            return None if a is None or b is None else _OPS[type(node.op)](a, b)
        return None
    try:
        return ev(ast.parse(expr, mode="eval"))
    except (SyntaxError, ZeroDivisionError, ValueError):
        return None


class FixDims(GraphPass):
    name = "fix_dims"

    def __init__(self, pins: dict[str, int]):
        super().__init__()
        self.pins = dict(pins)
        self.pinned: dict[str, str] = {}
        self.left: list[str] = []  # the input dims left dynamic, and the flags that would pin them
        self.flags: list[str] = []

    def summary(self) -> str:
        pinned = ", ".join(f"{k}={v}" for k, v in self.pinned.items())
        left = f"left dynamic: {', '.join(self.left)}; pin with --fix-dims {','.join(self.flags)}" if self.left else ""
        extra = "; ".join(x for x in (pinned, left) if x)
        return super().summary() + (f" [{extra}]" if extra else "")

    def report(self) -> dict:
        return super().report() | {"pinned": self.pinned, "left_dynamic": self.left,
                                   "suggest": f"--fix-dims {','.join(self.flags)}" if self.flags else None}

    def run(self, model: ir.Model) -> bool:
        known = names(model)
        by_axis = axis_pins(model, self.pins)
        values, self.pinned, self.left, self.flags = {}, {}, [], []
        for n in known:
            value = self.pins.get(n, default(n, known))
            if value is not None:
                values[n] = value
                self.pinned[n] = f"{value}" + ("" if n in self.pins else " (default)")
        self.pinned.update({f"{name}.{axis}": f"{value}" for (name, axis), value in by_axis.items()})
        pinned = 0
        for v in model.graph.inputs:
            dims = list(v.shape or ())
            for i, d in enumerate(dims):
                if isinstance(d, ir.SymbolicDim):
                    value = dim_value(d.value, values) if d.value else by_axis.get((v.name, i))
                    if value is None or value <= 0:
                        # the exact flag: a named dim by its (unpinned) names, an unnamed one by input and axis
                        flags = [f"{n}=VALUE" for n in _names(d.value) if n not in values] if d.value \
                            else [f"{v.name}.{i}=VALUE"]
                        self.left.append(f"{v.name}.{i} ({d.value or 'unnamed'})")
                        self.flags += [f for f in flags if f not in self.flags]
                        self.notes.append({"node": v.name, "op": "input", "reason": f"dim {i} ({d.value or 'unnamed'}) "
                                           f"left symbolic; pin it with --fix-dims {','.join(flags) or 'NAME=VALUE'}"})
                    else:
                        dims[i], pinned = value, pinned + 1
            if v.shape is not None and any(isinstance(d, ir.SymbolicDim) for d in v.shape):
                v.shape = ir.Shape(dims)
        if not pinned:
            return False
        self.stats["dims_pinned"] = pinned
        for node in model.graph:  # forget every shape computed from the old dims; inference gives them again
            for out in node.outputs:
                if out.shape is not None and not all(isinstance(d, int) for d in out.shape):
                    out.shape = None
        for _ in range(ROUNDS):
            ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
            folded = fold_constant_shapes(model)
            if not folded:
                break
            self.stats["shape_values_folded"] += folded
        return True


def fold_constant_shapes(model: ir.Model) -> int:
    """Replace Shape of a static tensor, and small values that depend on no graph input and feed a node that
    does (shape arithmetic, RoPE tables gathered at constant positions), by their values; returns how many."""
    graph, folded = model.graph, 0
    for node in [n for n in graph if n.op_type == "Shape" and static_shape(n.inputs[0]) is not None]:
        dims = np.array(static_shape(node.inputs[0]), np.int64)
        start, end = attr(node, "start", 0), attr(node, "end", None)
        replace_value(node.outputs[0], Builder(model, node, "fix_dims").const(dims[start:end], "shape"))
        folded += 1
    constant = {id(v) for v in graph.initializers.values()}
    frontier = []
    for node in graph:
        ins = [v for v in node.inputs if v is not None]
        if node.op_type not in RANDOM and all(id(v) in constant for v in ins):
            constant.update(id(o) for o in node.outputs)
        else:
            frontier += [v for v in ins if id(v) in constant and v.producer() is not None]
    values = list({id(v): v for v in frontier if static_shape(v) is None or np.prod(static_shape(v)) <= FOLD_ELEMENTS}.values())
    try:
        arrays = evaluate(model, [], values, []) if values else []
    except Exception:  # the arithmetic does not run on its own: leave it to onnxruntime at run time
        arrays = []
    for value, array in zip(values, arrays):
        if array.size <= FOLD_ELEMENTS:
            b = Builder(model, value.producer(), "fix_dims")
            replace_value(value, b.const(np.asarray(array), "shape_value"))
            folded += 1
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return folded
