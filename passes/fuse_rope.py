"""fuse_rope: x * cos + rotate_half(x) * sin  ==>  one RotaryEmbedding.

rotate_half is matched structurally in its two forms: Concat(-x[..., D/2:], x[..., :D/2])
(Llama: halves) and stack(-x[..., 1::2], x[..., ::2]).flatten(-2) (Cohere, GLM: pairs,
the op's interleaved=1). What cos and sin are is established by evaluation: they must be
a function of the positions input alone (or constants), hold each angle twice in the
form's order (cat(freqs, freqs) for halves, repeat_interleave(freqs, 2) for pairs), and
broadcast over heads. The cos/sin tables are then read off by evaluating the cos/sin
subgraphs for every position the table holds, so the op gets exactly the values the
graph computed. The table holds the rows of the constant cos/sin are gathered from, or,
when they are computed from the positions (transformers: inv_freq @ position_ids, then
cos/sin), one row per cache row: a step's positions index its cache. x in [B, T, H, D]
(the course) or [B, H, T, D] (transformers) is fed as [B, T, H*D] with num_heads: ONNX
`RotaryEmbedding` for `onnx`, com.microsoft's for `ort`.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import MOVEMENT_OPS, const, evaluator, graph_input_ancestors, sample_positions, scalar, static_shape
from .base import FusionPass, NotFused, Skip
from .build import Builder, replace_value


class FuseRoPE(FusionPass):
    name = "fuse_rope"
    candidate_ops = ("Add",)

    def __init__(self, contrib: bool):
        super().__init__()
        self.contrib = contrib  # onnxruntime's contrib op (com.microsoft) rather than the standard one

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        x, cos, sin, interleaved = _match(node)
        shape = static_shape(x)
        if shape is None or len(shape) != 4:
            raise NotFused(f"rotated tensor {x.name} has shape {shape}; expected static 4D")
        pos = _positions(cos, sin)
        layout, (batch, length, heads, dim) = _layout(shape, static_shape(cos), pos)
        cos_table, sin_table = _tables(model, cos, sin, pos, batch, length, dim, layout, interleaved)
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
        if self.contrib:
            rotated = b.op("RotaryEmbedding", [flat, pos, cos_v, sin_v], [batch, length, heads * dim], dtype,
                           domain="com.microsoft", num_heads=heads, interleaved=int(interleaved))
        else:
            rotated = b.op("RotaryEmbedding", [flat, cos_v, sin_v, pos], [batch, length, heads * dim], dtype,
                           num_heads=heads, interleaved=int(interleaved))
        out = b.op("Reshape", [rotated, b.const(np.array([batch, length, heads, dim], np.int64), "shape")],
                   [batch, length, heads, dim], dtype)
        if layout == "BHTD":
            out = b.op("Transpose", [out], shape, dtype, perm=[0, 2, 1, 3])
        replace_value(node.outputs[0], out)
        if self.contrib:
            model.opset_imports.setdefault("com.microsoft", 1)


def _match(add: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value, bool]:
    """Add(Mul(x, cos), Mul(rotate_half(x), sin)) in any operand order: (x, cos, sin, interleaved)."""
    muls = [v.producer() for v in add.inputs]
    if any(m is None or m.op_type != "Mul" for m in muls):
        raise Skip  # an ordinary Add: not a candidate, not counted
    for plain, rotated in (muls, muls[::-1]):
        for r_side in (0, 1):
            for interleaved, rotated_input in ((False, _rotate_half_input), (True, _rotate_pairs_input)):
                x = rotated_input(rotated.inputs[r_side])
                if x is None:
                    continue
                sin = rotated.inputs[1 - r_side]
                if plain.inputs[0] is x:
                    return x, plain.inputs[1], sin, interleaved
                if plain.inputs[1] is x:
                    return x, plain.inputs[0], sin, interleaved
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


def _rotate_pairs_input(value: ir.Value) -> ir.Value | None:
    """x when value == stack(-x[..., 1::2], x[..., ::2], axis=-1) flattened back to x's shape, else None."""
    flat = value.producer()
    stacked = flat.inputs[0].producer() if flat is not None and flat.op_type in ("Reshape", "Flatten") else None
    if stacked is None or stacked.op_type != "Concat" or len(stacked.inputs) != 2:
        return None
    neg, first = (_unsqueezed_last(v) for v in stacked.inputs)
    second = neg.inputs[0].producer() if neg is not None and neg.op_type == "Neg" else None
    x = first.inputs[0] if first is not None and first.op_type == "Slice" else None
    shape = static_shape(x)
    if x is None or second is None or second.op_type != "Slice" or second.inputs[0] is not x or shape is None:
        return None
    rank = len(shape)
    if stacked.attributes["axis"].value % (rank + 1) != rank or static_shape(value) != shape or shape[-1] % 2 \
            or not (_slice_is(first, rank, 0, shape[-1], 2) and _slice_is(second, rank, 1, shape[-1], 2)):
        return None
    return x


def _unsqueezed_last(value: ir.Value) -> ir.Node | None:
    """The producer of t when value == Unsqueeze(t, -1) (torch.stack's new last axis), else None."""
    node = value.producer()
    shape = static_shape(value)
    axes = const(node.inputs[1]) if node is not None and node.op_type == "Unsqueeze" else None
    if axes is None or shape is None or axes.size != 1 or int(axes.reshape(-1)[0]) % len(shape) != len(shape) - 1:
        return None
    return node.inputs[0].producer()


def _slice_is(node: ir.Node, rank: int, start: int, end: int, step: int = 1) -> bool:
    starts, ends = scalar(node.inputs[1]), scalar(node.inputs[2])
    axes = const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = scalar(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1
    if starts is None or ends is None or axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) % rank != rank - 1:
        return False
    return starts == start and min(ends, end) == end and steps == step


def _positions(cos: ir.Value, sin: ir.Value) -> ir.Value | None:
    """The one integer [B, T] graph input cos/sin are computed from, or None when they are constants."""
    sources = {id(s): s for v in (cos, sin) for s in graph_input_ancestors(v)}
    if not sources:
        return None
    if len(sources) != 1:
        raise NotFused(f"cos/sin depend on {len(sources)} graph inputs; expected the positions alone")
    pos = next(iter(sources.values()))
    shape = static_shape(pos)
    if shape is None or len(shape) != 2 or pos.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        raise NotFused(f"cos/sin come from {pos.name}, not an integer [B, T] positions input")
    return pos


def _layout(x_shape, cos_shape, pos) -> tuple[str, tuple[int, int, int, int]]:
    """x's layout and its (B, T, H, D). cos/sin broadcast over the heads, which says where T is, except when
    they broadcast over both middle axes (T = 1: cos [1, 1, D] against [B, H, 1, D]); then the positions' T does."""
    if cos_shape is None or len(cos_shape) > 4 or cos_shape[-1] != x_shape[-1]:
        raise NotFused(f"cos/sin of shape {cos_shape} do not broadcast along the head dim of {x_shape}")
    cos_shape = (1,) * (4 - len(cos_shape)) + tuple(cos_shape)
    batch, first, second, dim = x_shape
    layouts = []
    if cos_shape[2] == 1 and cos_shape[1] in (1, first):
        layouts.append(("BTHD", (batch, first, second, dim)))
    if cos_shape[1] == 1 and cos_shape[2] in (1, second):
        layouts.append(("BHTD", (batch, second, first, dim)))
    if not layouts:
        raise NotFused(f"cos/sin of shape {cos_shape} vary along the heads of {x_shape}")
    for layout in layouts:
        if pos is None or static_shape(pos) == layout[1][:2]:
            return layout
    raise NotFused(f"cos/sin come from {pos.name} {list(static_shape(pos))}, not one position per query of {x_shape}")


def _tables(model, cos, sin, pos, batch, length, dim, layout, interleaved):
    """(cos table [P, D/2], sin table [P, D/2]), read off the graph by evaluation."""
    if pos is None:
        c, s = const(cos), const(sin)
        if c is None or s is None:
            raise NotFused("cos/sin depend on no input but do not fold to constants")
        rows = [np.broadcast_to(t, (1,) * (4 - t.ndim) + t.shape) for t in (c, s)]
        rows = [t[0, :, 0] if layout == "BTHD" else t[0, 0] for t in rows]  # [T, D]
        rows = [np.broadcast_to(t, (length, dim)) for t in rows]
        return tuple(_angles(t, interleaved) for t in rows)
    capacity = _table_rows(model, cos)
    if capacity < length:
        raise NotFused(f"cos/sin table of {capacity} positions is shorter than the {length} queries")
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
    return tuple(_angles(t, interleaved) for t in tables)


def _rows(value: np.ndarray, layout: str, batch: int, length: int, dim: int) -> np.ndarray:
    """cos/sin evaluated for positions [B, T] -> [B, T, D]."""
    value = value.reshape((1,) * (4 - value.ndim) + value.shape)
    value = value[:, :, 0] if layout == "BTHD" else value[:, 0]
    return np.broadcast_to(value, (batch, length, dim))


def _angles(table: np.ndarray, interleaved: bool) -> np.ndarray:
    """The op's [P, D/2] table from the graph's [P, D], which must hold each angle twice in the rotation's order."""
    if interleaved:
        if not np.array_equal(table[..., ::2], table[..., 1::2]):
            raise NotFused("cos/sin pairs differ: not the repeat_interleave(freqs, 2) form of the interleaved rotation")
        return table[..., ::2]
    half = table.shape[-1] // 2
    if not np.array_equal(table[..., :half], table[..., half:]):
        raise NotFused("cos/sin halves differ: not the cat(freqs, freqs) rotate_half form")
    return table[..., :half]


def _table_rows(model: ir.Model, value: ir.Value) -> int:
    """How many positions the table behind `value` must hold: the rows of the constant it gathers from, but no more
    than the caches hold ([B, Hkv, C, D] float inputs a scatter writes: the contract's positions are below C, and each
    row is one evaluation; a 0.6B model gathers from 32768 rows); with no such constant, the caches' rows (the
    evaluation then checks each row)."""
    caches = [static_shape(v)[2] for v in model.graph.inputs if _is_written_cache(v)]
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        node = v.producer() if v is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in ("Gather", "GatherND") and const(node.inputs[0]) is not None:
            rows = int(static_shape(node.inputs[0])[0])
            return min(rows, max(caches)) if caches else rows
        stack.extend(node.inputs)
    if not caches:
        raise NotFused("cos/sin are computed from the positions, not gathered from a table, and no [B, Hkv, C, D] "
                       "cache input written by a scatter bounds the positions")
    return max(caches)


SCATTERS = ("ScatterND", "ScatterElements", "TensorScatter")


def _is_written_cache(value: ir.Value) -> bool:
    """A 4D float graph input that reaches the data input of a scatter through data movement only: a cache the
    step writes at its positions (a 4D input that is only read, such as x itself, bounds nothing)."""
    shape = static_shape(value)
    if shape is None or len(shape) != 4 or value.dtype is None or not value.dtype.is_floating_point():
        return False
    stack = [value]
    while stack:
        for user, index in stack.pop().uses():
            if index == 0 and user.op_type in SCATTERS:
                return True
            if index == 0 and user.op_type in MOVEMENT_OPS:
                stack.extend(user.outputs)
    return False
