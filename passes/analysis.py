"""Facts about values that the fusion passes rely on, established by evaluation, not by trust.

- `trace_movement` walks a value back through pure data-movement ops (Transpose,
  Reshape, Expand, Unsqueeze, Tile, Gather with constant indices, ...) and scalar
  multiplications to its source. Because every shape is static, `element_ids` can then
  run that chain in numpy on a tensor of element ids: the result says exactly which
  source element lands where, so a GQA repeat, its head order, and the transpose that
  is left once the repeat is gone are read off the ids instead of guessed from op shapes.
- `evaluate` runs the subgraph that computes a value from chosen graph inputs in
  onnxruntime, to check what a mask or a scatter index really is for sample positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

MOVEMENT_OPS = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Flatten", "Identity", "Gather"}


def const(value: ir.Value | None) -> np.ndarray | None:
    """The value's content when it is an initializer or a Constant's output, else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def scalar(value: ir.Value | None) -> float | None:
    """A constant holding one number (any shape of size 1)."""
    c = const(value)
    return float(c.reshape(())) if c is not None and c.size == 1 else None


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None or value.shape is None:
        return None
    dims = tuple(value.shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


@dataclass
class Trace:
    """`value` = chain(source) * scale, with `chain` the movement nodes from source to value.

    Values after chain node `unscaled - 1` already carry (part of) the scale.
    """
    source: ir.Value
    chain: list[ir.Node] = field(default_factory=list)
    scale: float = 1.0
    unscaled: int = 0


def trace_movement(value: ir.Value, allow_scale: bool = False) -> Trace:
    """Walk back from `value` while the producer only moves data (or, if allowed, scales by a constant)."""
    chain, scale, scaled_after = [], 1.0, 0
    while (node := value.producer()) is not None:
        data = node.inputs[0] if node.inputs else None
        if node.op_type in MOVEMENT_OPS and data is not None and _movement_consts_known(node):
            chain.append(node)
            value = data
            continue
        if allow_scale and node.op_type in ("Mul", "Div") and len(node.inputs) == 2:
            a, b = node.inputs
            if node.op_type == "Mul" and scalar(a) is not None and scalar(b) is None:
                scale, value, scaled_after = scale * scalar(a), b, len(chain)
                continue
            if scalar(b) is not None and scalar(a) is None and scalar(b) != 0:
                scale = scale * scalar(b) if node.op_type == "Mul" else scale / scalar(b)
                value, scaled_after = a, len(chain)
                continue
        break
    return Trace(value, chain[::-1], scale, len(chain) - scaled_after)


def _movement_consts_known(node: ir.Node) -> bool:
    return all(const(v) is not None for v in node.inputs[1:] if v is not None)


def chain_value(trace: Trace, start: int) -> ir.Value:
    """The value the chain's node `start` reads: the source for 0, else the output of node start - 1."""
    return trace.source if start == 0 else trace.chain[start - 1].outputs[0]


def element_ids(trace: Trace, start: int = 0) -> np.ndarray | None:
    """Run the chain from node `start` on ids 0..n-1 laid out in `chain_value(trace, start)`'s shape."""
    shape = static_shape(chain_value(trace, start))
    if shape is None:
        return None
    x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    for node in trace.chain[start:]:
        x = _move(node, x)
        if x is None:
            return None
    return x


def _move(node: ir.Node, x: np.ndarray) -> np.ndarray | None:
    args = [const(v) for v in node.inputs[1:]]
    op = node.op_type
    if op == "Identity":
        return x
    if op == "Transpose":
        return x.transpose(attr(node, "perm", list(range(x.ndim))[::-1]))
    if op == "Reshape":
        shape = [x.shape[i] if d == 0 and not attr(node, "allowzero", 0) else d for i, d in enumerate(args[0].tolist())]
        return x.reshape(shape)
    if op == "Unsqueeze":
        axes = sorted(int(a) % (x.ndim + len(args[0])) for a in args[0].reshape(-1))
        for a in axes:
            x = np.expand_dims(x, a)
        return x
    if op == "Squeeze":
        return np.squeeze(x, tuple(int(a) for a in args[0].reshape(-1))) if args and args[0] is not None else np.squeeze(x)
    if op == "Expand":
        return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(args[0].tolist()))).copy()
    if op == "Tile":
        return np.tile(x, args[0].tolist())
    if op == "Flatten":
        axis = attr(node, "axis", 1) % max(x.ndim, 1)
        return x.reshape(int(np.prod(x.shape[:axis])), -1)
    if op == "Gather":
        return np.take(x, args[0], axis=attr(node, "axis", 0))
    return None


def group_repeat(ids: np.ndarray, axis: int = 1) -> int:
    """The largest n such that `ids` is each slice along `axis` repeated n times in a row (h0,h0,h1,h1)."""
    size = ids.shape[axis]
    # a cache's ids are millions (a 0.6B model's: 8 heads x 2048 rows x 128): each n is tried on one element per slice
    # first, and only one that holds there on the whole array
    probe = ids[tuple(slice(None) if a == axis else slice(0, 1) for a in range(ids.ndim))]
    for n in sorted((d for d in range(1, size + 1) if size % d == 0), reverse=True):
        if _repeated(probe, n, axis) and _repeated(ids, n, axis):
            return n
    return 1


def _repeated(ids: np.ndarray, n: int, axis: int) -> bool:
    base = np.take(ids, np.arange(0, ids.shape[axis], n), axis=axis)
    return np.array_equal(np.repeat(base, n, axis=axis), ids)


def has_duplicates(ids: np.ndarray) -> bool:
    """Whether some element id occurs twice (ids are 0..n-1 moved about: counting is linear, np.unique sorts)."""
    return ids.size > 0 and int(np.bincount(ids.ravel()).max()) > 1


def as_view(ids: np.ndarray, source_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(reshape, perm) with source.reshape(reshape).transpose(perm) == ids, if such a view exists."""
    if ids.size != int(np.prod(source_shape)) or (ids.size and ids.reshape(-1)[0] != 0):
        return None
    n = ids.ndim
    stride = [int(ids[(0,) * a + (1,) + (0,) * (n - a - 1)]) if ids.shape[a] > 1 else 0 for a in range(n)]
    order = sorted((a for a in range(n) if ids.shape[a] > 1), key=lambda a: -stride[a])
    for a in (a for a in range(n) if ids.shape[a] == 1):  # size-1 axes stay beside their left neighbour
        order.insert(order.index(a - 1) + 1 if a > 0 and (a - 1) in order else 0, a)
    reshape = tuple(ids.shape[a] for a in order)
    perm = tuple(order.index(a) for a in range(n))
    if not np.array_equal(np.arange(ids.size).reshape(reshape).transpose(perm), ids):
        return None
    return reshape, perm


def evaluator(model: ir.Model, inputs: list[ir.Value], outputs: list[ir.Value]):
    """A function feeds -> outputs running the part of `model` that computes `outputs` from `inputs` alone (raises
    ValueError if it needs more); one onnxruntime session, however many times it is called."""
    import onnxruntime as ort

    sub = ir.convenience.extract(model.graph, inputs=inputs, outputs=outputs)
    sub_model = ir.Model(sub, ir_version=model.ir_version)
    proto = ir.serde.serialize_model(sub_model)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures surface as exceptions, not log lines
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [v.name for v in sub.inputs]
    return lambda feeds: session.run(None, dict(zip(names, feeds)))


def evaluate(model: ir.Model, inputs: list[ir.Value], outputs: list[ir.Value], feeds: list[np.ndarray]) -> list[np.ndarray]:
    """Run the part of `model` that computes `outputs` from `inputs` alone, once."""
    return evaluator(model, inputs, outputs)(feeds)


def graph_input_ancestors(value: ir.Value) -> list[ir.Value]:
    """The graph inputs (not initializers) that `value` is computed from."""
    seen, found, stack = set(), {}, [value]
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            found[id(v)] = v
        node = v.producer()
        if node is not None:
            stack.extend(node.inputs)
    return list(found.values())


def position_source(value: ir.Value, what: str, fail) -> ir.Value:
    """The one integer [B, T] graph input (position_ids) that `value` is computed from, or fail(reason)."""
    sources = graph_input_ancestors(value)
    if len(sources) != 1:
        raise fail(f"{what} depends on {[s.name for s in sources] or 'no graph input'}; expected positions alone")
    pos = sources[0]
    if pos.dtype not in (ir.DataType.INT64, ir.DataType.INT32) or static_shape(pos) is None or len(pos.shape) != 2:
        raise fail(f"{what} comes from {pos.name}, which is not a static integer [B, T] tensor of positions")
    return pos


def sample_positions(batch: int, length: int, capacity: int, dtype) -> list[np.ndarray]:
    """Valid position_ids [B, T] (consecutive rows, p0 + T <= C): empty cache, full cache, mixed rows."""
    last = capacity - length
    starts = [[0] * batch, [last] * batch, [(7 * b + last // 2) % (last + 1) for b in range(batch)]]
    return [(np.array(s)[:, None] + np.arange(length)[None]).astype(dtype) for s in starts]
