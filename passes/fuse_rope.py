"""fuse_rope: x * cos + rotate_half(x) * sin  ==>  one RotaryEmbedding.

rotate_half(x) = Concat(-x[..., D/2:], x[..., :D/2]) is matched structurally; what cos
and sin are is established by evaluation: they must be a function of the positions
input alone (or constants), hold each angle twice (cat(freqs, freqs), the non-interleaved
form), and broadcast over heads. The cos/sin tables are then read off by evaluating the
cos/sin subgraphs for every position the table holds, so the op gets exactly the values
the graph computed. x in [B, T, H, D] (the course) or [B, H, T, D] (transformers) is fed
as [B, T, H*D] with num_heads: ONNX `RotaryEmbedding` for `onnx`, com.microsoft's for `ort`.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import const, evaluator, graph_input_ancestors, sample_positions, scalar, static_shape
from .base import FusionPass, NotFused, Skip
from .build import Builder, replace_value


class FuseRoPE(FusionPass):
    name = "fuse_rope"
    candidate_ops = ("Add",)

    def __init__(self, target: str):
        super().__init__()
        self.target = target

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        x, cos, sin = _match(node)
        shape = static_shape(x)
        if shape is None or len(shape) != 4:
            raise NotFused(f"rotated tensor {x.name} has shape {shape}; expected static 4D")
        layout = _layout(shape, static_shape(cos))
        batch, length, heads, dim = (shape[0], shape[1], shape[2], shape[3]) if layout == "BTHD" else \
            (shape[0], shape[2], shape[1], shape[3])
        pos, cos_table, sin_table = _tables(model, cos, sin, batch, length, dim, layout)
        b = Builder(model, node, f"{self.name}/{node.name}")
        dtype = x.dtype
        flat = x if layout == "BTHD" else b.op("Transpose", [x], [batch, length, heads, dim], dtype, perm=[0, 2, 1, 3])
        flat = b.op("Reshape", [flat, b.const(np.array([batch, length, heads * dim], np.int64), "shape")],
                    [batch, length, heads * dim], dtype)
        cos_v, sin_v = b.const(cos_table.astype(dtype.numpy()), "cos_cache"), b.const(sin_table.astype(dtype.numpy()), "sin_cache")
        if pos is None:  # constant angles: positions 0..T-1 into a table of T rows
            pos = b.const(np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length)).copy(), "positions")
        elif pos.dtype != ir.DataType.INT64:
            pos = b.op("Cast", [pos], [batch, length], ir.DataType.INT64, to=int(ir.DataType.INT64))
        if self.target == "ort":
            rotated = b.op("RotaryEmbedding", [flat, pos, cos_v, sin_v], [batch, length, heads * dim], dtype,
                           domain="com.microsoft", num_heads=heads, interleaved=0)
        else:
            rotated = b.op("RotaryEmbedding", [flat, cos_v, sin_v, pos], [batch, length, heads * dim], dtype,
                           num_heads=heads, interleaved=0)
        out = b.op("Reshape", [rotated, b.const(np.array([batch, length, heads, dim], np.int64), "shape")],
                   [batch, length, heads, dim], dtype)
        if layout == "BHTD":
            out = b.op("Transpose", [out], shape, dtype, perm=[0, 2, 1, 3])
        replace_value(node.outputs[0], out)
        if self.target == "ort":
            model.opset_imports.setdefault("com.microsoft", 1)


def _match(add: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Add(Mul(x, cos), Mul(rotate_half(x), sin)) in any operand order: (x, cos, sin)."""
    muls = [v.producer() for v in add.inputs]
    if any(m is None or m.op_type != "Mul" for m in muls):
        raise Skip  # an ordinary Add: not a candidate, not counted
    for plain, rotated in (muls, muls[::-1]):
        for r_side in (0, 1):
            x = _rotate_half_input(rotated.inputs[r_side])
            if x is None:
                continue
            sin = rotated.inputs[1 - r_side]
            if plain.inputs[0] is x:
                return x, plain.inputs[1], sin
            if plain.inputs[1] is x:
                return x, plain.inputs[0], sin
    raise Skip


def _rotate_half_input(value: ir.Value) -> ir.Value | None:
    """x when value == Concat(-x[..., h:], x[..., :h]) along the last axis, else None."""
    concat = value.producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return None
    neg, first = (v.producer() for v in concat.inputs)
    if neg is None or neg.op_type != "Neg" or first is None:
        return None
    second = neg.inputs[0].producer()
    x = first.inputs[0] if first.op_type == "Slice" else None
    shape = static_shape(x)
    if x is None or second is None or second.op_type != "Slice" or second.inputs[0] is not x or shape is None:
        return None
    rank, half = len(shape), shape[-1] // 2
    axis = concat.attributes["axis"].value % rank
    if axis != rank - 1 or shape[-1] % 2 or not (_slice_is(first, rank, 0, half) and _slice_is(second, rank, half, shape[-1])):
        return None
    return x


def _slice_is(node: ir.Node, rank: int, start: int, end: int) -> bool:
    starts, ends = scalar(node.inputs[1]), scalar(node.inputs[2])
    axes = const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = scalar(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1
    if starts is None or ends is None or axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) % rank != rank - 1:
        return False
    return starts == start and min(ends, end) == end and steps == 1


def _layout(x_shape, cos_shape) -> str:
    if cos_shape is None or len(cos_shape) > 4 or cos_shape[-1] != x_shape[-1]:
        raise NotFused(f"cos/sin of shape {cos_shape} do not broadcast along the head dim of {x_shape}")
    cos_shape = (1,) * (4 - len(cos_shape)) + tuple(cos_shape)
    if cos_shape[2] == 1 and cos_shape[1] in (1, x_shape[1]):
        return "BTHD"
    if cos_shape[1] == 1 and cos_shape[2] in (1, x_shape[2]):
        return "BHTD"
    raise NotFused(f"cos/sin of shape {cos_shape} vary along the heads of {x_shape}")


def _tables(model, cos, sin, batch, length, dim, layout):
    """(positions input or None, cos table [P, D/2], sin table [P, D/2]), read off the graph by evaluation."""
    sources = {id(s): s for v in (cos, sin) for s in graph_input_ancestors(v)}
    if not sources:
        c, s = const(cos), const(sin)
        if c is None or s is None:
            raise NotFused("cos/sin depend on no input but do not fold to constants")
        rows = [np.broadcast_to(t, (1,) * (4 - t.ndim) + t.shape) for t in (c, s)]
        rows = [t[0, :, 0] if layout == "BTHD" else t[0, 0] for t in rows]  # [T, D]
        rows = [np.broadcast_to(t, (length, dim)) for t in rows]
        return None, *(_halves(t) for t in rows)
    if len(sources) != 1:
        raise NotFused(f"cos/sin depend on {len(sources)} graph inputs; expected the positions alone")
    pos = next(iter(sources.values()))
    if static_shape(pos) != (batch, length) or pos.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        raise NotFused(f"cos/sin come from {pos.name}, not an integer [B, T] positions input")
    capacity = _table_rows(cos)
    tables = [np.zeros((capacity, dim), np.float64) for _ in range(2)]
    run = evaluator(model, [pos], [cos, sin])
    for p0 in range(0, capacity, length):
        p0 = min(p0, capacity - length)
        sample = np.broadcast_to(np.arange(p0, p0 + length), (batch, length)).astype(pos.dtype.numpy())
        for table, got in zip(tables, run([sample])):
            table[p0:p0 + length] = _rows(got, layout, batch, length, dim)[0]
    for sample in sample_positions(batch, length, capacity, pos.dtype.numpy()):
        for table, got in zip(tables, run([sample])):
            if not np.allclose(_rows(got, layout, batch, length, dim), table[sample], rtol=0, atol=1e-6):
                raise NotFused("cos/sin are not a function of each position alone")
    return pos, *(_halves(t) for t in tables)


def _rows(value: np.ndarray, layout: str, batch: int, length: int, dim: int) -> np.ndarray:
    """cos/sin evaluated for positions [B, T] -> [B, T, D]."""
    value = value.reshape((1,) * (4 - value.ndim) + value.shape)
    value = value[:, :, 0] if layout == "BTHD" else value[:, 0]
    return np.broadcast_to(value, (batch, length, dim))


def _halves(table: np.ndarray) -> np.ndarray:
    half = table.shape[-1] // 2
    if not np.array_equal(table[..., :half], table[..., half:]):
        raise NotFused("cos/sin halves differ: not the cat(freqs, freqs) rotate_half form")
    return table[..., :half]


def _table_rows(value: ir.Value) -> int:
    """How many positions the table behind `value` holds: the rows of the constant it gathers from."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        node = v.producer() if v is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in ("Gather", "GatherND") and const(node.inputs[0]) is not None:
            return int(static_shape(node.inputs[0])[0])
        stack.extend(node.inputs)
    raise NotFused("cos/sin depend on the positions but not through a gather from a constant table")
