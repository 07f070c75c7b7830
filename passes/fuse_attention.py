"""fuse_attention: MatMul(Q, K^T) -> scale -> [soft-cap] -> mask -> Softmax -> MatMul(., V)  ==>  one ONNX `Attention`.

The matched chain, walking up from each Softmax:

    scores = MatMul(Q', K'^T)            Q', K' any movement of Q, K (transposes, GQA repeat),
    [Mul | Div by a constant]            possibly scaled by constants on the way
    [Mul(Tanh(s / cap), cap)]            logit soft-capping (Gemma-2): the op's `softcap`
    [Where(mask, s, -big) | Add(s, m)]   boolean or additive masks, in any order with the scale
    [Cast]  Softmax(axis=-1)  [Cast]     softmax in fp32 for fp16 models
    [Where(IsNaN(p), 0, p)]              torch's NaN guard after a boolean-masked SDPA
    out = MatMul(p, V')

The products may be written in any batched form: [B, H, T, D] as the course writes it,
[B*H, T, D], a grouped [B, Hkv, rep, T, D] against [B, Hkv, 1, S, D] (einsum's broadcast),
or query heads folded into rows, [B, Hkv, rep*T, D] against the un-repeated K/V. `Frame`
reads every such form as attention over [batch, heads, rows, D]; Q', K' and V' are traced
back to their source tensors and the movement between is run on element ids (see
analysis.py). That reveals a GQA repeat of K/V, checks it is the consecutive one
(h0,h0,h1,h1) Attention implements, tells which fold of Q's rows is its heads, and leaves
a plain reshape / transpose from each source to the operand the fused op takes. The repeat
is dropped, not copied into the fused op. Masks are brought into the [1|B, 1|H, T, S] shape
onnxruntime's kernel takes. An `Attention` torch already emitted (SDPA at opset >= 23)
with a repeat in front of its K/V gets the repeat removed the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from .analysis import (as_view, chain_value, const, element_ids, group_repeat, has_duplicates, scalar, static_shape,
                       trace_movement)
from .base import FusionPass, NotFused, Skip
from .build import Builder, replace_value

VERY_NEGATIVE = -1e4  # a fill at or below this is a mask, not arithmetic (finfo(fp16).min is -65504)


class FuseAttention(FusionPass):
    name = "fuse_attention"
    candidate_ops = ("Softmax", "Attention")
    min_opset = 23

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        if node.op_type == "Attention":
            return self._drop_repeat(model, node)
        matmul_out = _probs_consumer(node)
        scores = _scores_chain(node.inputs[0])
        q_trace = trace_movement(scores.matmul.inputs[0], allow_scale=True)
        k_trace = trace_movement(scores.matmul.inputs[1], allow_scale=True)
        v_trace = trace_movement(matmul_out.inputs[1])
        frame = Frame(_ids(q_trace, "Q"), _ids(k_trace, "K^T").swapaxes(-1, -2), _ids(v_trace, "V"))
        out = matmul_out.outputs[0]
        if static_shape(out) is None:
            raise NotFused(f"attention output {out.name} has no static shape")
        fold = _query_fold(frame, q_trace)
        rep = math.gcd(group_repeat(frame.k), group_repeat(frame.v))
        b = Builder(model, matmul_out, f"{self.name}/{node.name}")
        q = _operand(b, q_trace, lambda ids: frame.fold(frame.four(ids), fold), "Q")
        k = _operand(b, k_trace, lambda ids: frame.four(ids.swapaxes(-1, -2))[:, ::rep], "K")
        v = _operand(b, v_trace, lambda ids: frame.four(ids)[:, ::rep], "V")
        inputs = [q, k, v] + ([_mask(b, scores.masks, frame, fold, q.dtype)] if scores.masks else [])
        attrs = {"scale": float(scores.scale * q_trace.scale * k_trace.scale)}
        if scores.softcap:
            attrs["softcap"] = float(scores.softcap)
        if scores.fp32 and q.dtype != ir.DataType.FLOAT:
            attrs["softmax_precision"] = int(ir.DataType.FLOAT)
        heads, rows = frame.heads * fold, frame.rows // fold
        fused = b.op("Attention", inputs, [frame.batch, heads, rows, static_shape(v)[-1]], out.dtype, **attrs)
        replace_value(out, _reshape(b, fused, static_shape(out)))
        self._count_repeat(node, rep * fold, frame.k)

    def _drop_repeat(self, model: ir.Model, node: ir.Node) -> None:
        """An existing Attention with 4D K/V: remove a GQA repeat in front of them, if there is one."""
        k_in, v_in = node.inputs[1], node.inputs[2]
        k_trace, v_trace = trace_movement(k_in), trace_movement(v_in)
        k_ids, v_ids = _ids(k_trace, "K"), _ids(v_trace, "V")
        if k_ids.ndim != 4:
            raise Skip
        rep = math.gcd(group_repeat(k_ids), group_repeat(v_ids))
        if rep == 1:
            raise Skip  # nothing repeated: already the fused form
        b = Builder(model, node, f"{self.name}/{node.name}")
        k = _operand(b, k_trace, lambda ids: ids[:, ::rep], "K")
        v = _operand(b, v_trace, lambda ids: ids[:, ::rep], "V")
        node.replace_input_with(1, k)
        node.replace_input_with(2, v)
        self._count_repeat(node, rep, k_ids)

    def _count_repeat(self, node: ir.Node, rep: int, k_ids: np.ndarray) -> None:
        if rep > 1:
            self.stats["repeat_removed"] += 1
        elif has_duplicates(k_ids):
            self.stats["repeat_kept"] += 1
            self.note(node, "K/V heads are repeated in an order Attention cannot group (not h0,h0,h1,h1): "
                            "fused with the repeat kept")


class Frame:
    """The two batched products as written, read as attention over [batch, heads, rows, D].

    Operands are right-aligned and broadcast over their leading (batch) axes, as MatMul does;
    the first leading axis is the batch and the others together are the heads (a single
    leading axis, [B*H, T, D], is all heads of a batch of one). K and V broadcast where Q does
    not are repeated heads: the ids show it like any other repeat.
    """

    def __init__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        if min(q.ndim, k.ndim, v.ndim) < 2:
            raise NotFused(f"Q, K, V have ranks {q.ndim}, {k.ndim}, {v.ndim}; expected matrices or batches of them")
        self.rank = max(q.ndim, k.ndim, v.ndim)
        try:
            lead = np.broadcast_shapes(*(x.shape[:-2] for x in (self._pad(q), self._pad(k), self._pad(v))))
        except ValueError:
            raise NotFused(f"Q {q.shape}, K {k.shape}, V {v.shape} do not broadcast as batched MatMuls") from None
        self.lead = tuple(lead)
        if self._pad(q).shape[:-2] != self.lead:
            raise NotFused(f"Q {q.shape} is broadcast over the leading axes of K/V {k.shape}")
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise NotFused(f"Q {q.shape}, K {k.shape}, V {v.shape}: head sizes or key counts differ")
        self.batch, self.heads = (lead[0], math.prod(lead[1:])) if len(lead) >= 2 else (1, math.prod(lead))
        self.rows, self.keys = q.shape[-2], k.shape[-2]
        self.q, self.k, self.v = self.four(q), self.four(k), self.four(v)

    def _pad(self, x: np.ndarray) -> np.ndarray:
        return x.reshape((1,) * (self.rank - x.ndim) + x.shape)

    def four(self, ids: np.ndarray) -> np.ndarray:
        """An operand's ids as [batch, heads, n, d]."""
        ids = np.broadcast_to(self._pad(ids), self.lead + ids.shape[-2:])
        return ids.reshape(self.batch, self.heads, *ids.shape[-2:])

    def fold(self, q4: np.ndarray, fold: int) -> np.ndarray:
        """Q's rows r*T + t as heads h*fold + r: [batch, heads, fold*T, D] -> [batch, heads*fold, T, D]."""
        return q4.reshape(self.batch, self.heads * fold, self.rows // fold, q4.shape[-1])


def _query_fold(frame: Frame, q_trace) -> int:
    """How many query heads each row block of Q holds: 1, unless Q's rows are rep*T with query heads folded in.

    A fold is a reading of Q's rows under which Q is a plain view of its source; the one that
    keeps the source's own axes (up to size-1 axes and heads*D merged) is the one the code
    wrote. Among none such, no fold: attention over rep*T rows is the same numbers.
    """
    source = static_shape(q_trace.source)
    viewable = []
    for fold in (f for f in range(1, frame.rows + 1) if frame.rows % f == 0):
        view = as_view(frame.fold(frame.q, fold), source)
        if view is not None:
            if _keeps_axes(view[0], source):
                return fold  # the usual case, fold 1, returns at the first try
            viewable.append(fold)
    if viewable:
        return 1 if 1 in viewable else viewable[0]
    raise NotFused(f"Q is not a reshape/transpose of {q_trace.source.name}")


def _keeps_axes(reshape: tuple, source: tuple) -> bool:
    squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
    r, s = squeeze(reshape), squeeze(source)
    return r == s or (len(r) >= 2 and r[:-2] + (r[-2] * r[-1],) == s)


def _ids(trace, what: str) -> np.ndarray:
    ids = element_ids(trace)
    if ids is None:
        raise NotFused(f"{what} comes from {trace.source.name} without a static shape")
    return ids


def _operand(b: Builder, trace, select, what: str) -> ir.Value:
    """The fused op's operand: `select` maps the chain's element ids to the operand's.

    The latest value along the chain that already is the operand (often the cache
    itself) and carries none of the folded scale is used as is; failing that, a
    reshape/transpose of the traced source.
    """
    for start in range(trace.unscaled, -1, -1):
        ids = element_ids(trace, start)
        if ids is None:
            continue
        ids = select(ids)
        if static_shape(chain_value(trace, start)) == ids.shape and np.array_equal(ids.reshape(-1), np.arange(ids.size)):
            return chain_value(trace, start)
    ids = select(element_ids(trace))
    view = as_view(ids, static_shape(trace.source))
    if view is None:
        raise NotFused(f"{what} is not a reshape/transpose of {trace.source.name} once a consecutive (h0,h0,h1,h1) "
                       "head repeat is removed")
    return b.view(trace.source, *view)


def _probs_consumer(softmax: ir.Node) -> ir.Node:
    """The MatMul(p, V) the softmax output feeds, through Casts and torch's NaN guard."""
    rank = len(softmax.inputs[0].shape or ())
    axis = softmax.attributes.get("axis")
    if rank == 0 or (axis is not None and axis.value % rank != rank - 1):
        raise NotFused(f"softmax over axis {axis.value if axis else '?'}; expected the last axis")
    p = softmax.outputs[0]
    while True:
        if p.is_graph_output():
            raise NotFused(f"attention weights {p.name} are a graph output")
        users = list({id(u): u for u, _ in p.uses()}.values())
        guard = _nan_guard(p, users)
        if guard is not None:
            p = guard.outputs[0]
            continue
        if len(users) != 1:
            raise NotFused(f"softmax output feeds {len(users)} nodes ({', '.join(u.op_type for u in users)}); "
                           "expected one MatMul with V")
        user = users[0]
        if user.op_type == "Cast":
            p = user.outputs[0]
        elif user.op_type == "MatMul" and user.inputs[0] is p:
            return user
        else:
            raise NotFused(f"softmax output feeds {user.op_type} ({user.name}); expected MatMul(weights, V)")


def _nan_guard(p: ir.Value, users: list[ir.Node]) -> ir.Node | None:
    """Where(IsNaN(p), 0, p), as torch emits after a boolean-masked SDPA."""
    if len(users) != 2 or {u.op_type for u in users} != {"IsNaN", "Where"}:
        return None
    isnan = next(u for u in users if u.op_type == "IsNaN")
    where = next(u for u in users if u.op_type == "Where")
    cond, zero, same = where.inputs
    return where if cond is isnan.outputs[0] and same is p and scalar(zero) == 0.0 else None


@dataclass
class Scores:
    matmul: ir.Node | None = None
    masks: list = field(default_factory=list)
    scale: float = 1.0
    softcap: float = 0.0
    fp32: bool = False


def _scores_chain(x: ir.Value) -> Scores:
    """Walk up from the softmax input to MatMul(Q, K^T), collecting masks, scale and soft-cap."""
    s, capped = Scores(), False
    while True:
        node = x.producer()
        if node is None:
            raise NotFused(f"scores come from graph input {x.name}; expected MatMul(Q, K^T)")
        op = node.op_type
        if op == "MatMul":
            s.matmul = node
            if capped:  # scale so far is the one inside the tanh: attention scale / cap
                s.scale *= s.softcap
            return s
        if op == "Cast":
            s.fp32 |= node.attributes["to"].value == ir.DataType.FLOAT
            x = node.inputs[0]
        elif op in ("Mul", "Div") and _constant_side(node) is not None:
            i = _constant_side(node)
            c = scalar(node.inputs[i])
            if c is None or (op == "Div" and i == 0):
                raise NotFused(f"scores scaled by a non-scalar {node.inputs[i].name} in {op} ({node.name})")
            s.scale = s.scale * c if op == "Mul" else s.scale / c
            x = node.inputs[1 - i]
        elif op == "Tanh":
            if capped or not s.scale > 0:
                raise NotFused(f"Tanh ({node.name}) on the scores is not one soft-cap cap * tanh(s / cap)")
            s.softcap, s.scale, capped = s.scale, 1.0, True
            x = node.inputs[0]
        elif op in ("Add", "Where") and capped:
            raise NotFused(f"{op} ({node.name}) masks the scores inside the soft-cap; expected the mask after it")
        elif op == "Add":
            a, m = _split_scores(node)
            if s.scale != 1.0:
                raise NotFused(f"additive mask {m.name} is added before the scores are scaled; expected it after")
            s.masks.append(("add", m))
            x = a
        elif op == "Where":
            cond, a, c = node.inputs
            fill_a, fill_c = scalar(a), scalar(c)
            if fill_c is not None and fill_a is None and fill_c <= VERY_NEGATIVE:
                s.masks.append(("keep", cond))
                x = a
            elif fill_a is not None and fill_c is None and fill_a <= VERY_NEGATIVE:
                s.masks.append(("drop", cond))
                x = c
            else:
                raise NotFused(f"Where ({node.name}) on the scores does not fill with a large negative constant")
        else:
            raise NotFused(f"scores pass through {op} ({node.name}); expected Cast/Mul/Div/Tanh/Add/Where back to "
                           "MatMul(Q, K^T)")


def _constant_side(node: ir.Node) -> int | None:
    sides = [i for i, v in enumerate(node.inputs) if const(v) is not None]
    return sides[0] if len(sides) == 1 else None


def _split_scores(add: ir.Node) -> tuple[ir.Value, ir.Value]:
    """(scores side, mask side) of Add: the scores side leads back to the QK^T MatMul."""
    a, b = add.inputs
    for side, other in ((a, b), (b, a)):
        if _leads_to_matmul(side):
            return side, other
    raise NotFused(f"neither input of Add ({add.name}) leads back to MatMul(Q, K^T)")


def _leads_to_matmul(x: ir.Value, depth: int = 8) -> bool:
    node = x.producer()
    for _ in range(depth):
        if node is None:
            return False
        if node.op_type == "MatMul":
            return True
        if node.op_type not in ("Cast", "Mul", "Div", "Add", "Where", "Tanh"):
            return False
        data = [v for v in node.inputs if v is not None and const(v) is None]
        if node.op_type == "Where":
            data = data[1:]
        data = [v for v in data if v.shape is not None and len(v.shape) == len(x.shape)]
        node = data[0].producer() if data else None
    return False


def _mask(b: Builder, masks: list, frame: Frame, fold: int, dtype: ir.DataType) -> ir.Value:
    """All masks as one attn_mask: boolean (True = attend) when they all are, else additive in `dtype`."""
    keep, add = [], []
    for kind, m in masks:
        if kind == "add":
            kind, m = _bool_form(m) or (kind, m)
        if kind == "drop":
            kind, m = "keep", _keep(b, m)
        (keep if kind == "keep" else add).append(_canonical_mask(b, m, frame, fold))
    mask = None
    for m in keep:
        mask = m if mask is None else b.op("And", [mask, m], np.broadcast_shapes(static_shape(mask), static_shape(m)), ir.DataType.BOOL)
    if not add:
        return mask
    if mask is not None:
        zero, neg = b.const(np.array(0, dtype.numpy())), b.const(np.array(-np.inf, dtype.numpy()))
        add.append(b.op("Where", [mask, zero, neg], static_shape(mask), dtype))
    total = None
    for m in add:
        if m.dtype != dtype:
            m = b.op("Cast", [m], static_shape(m), dtype, to=int(dtype))
        total = m if total is None else b.op("Add", [total, m], np.broadcast_shapes(static_shape(total), static_shape(m)), dtype)
    return total


def _canonical_mask(b: Builder, m: ir.Value, frame: Frame, fold: int) -> ir.Value:
    """A mask in the scores' frame as [1|batch, 1|heads, T, S]: the shapes onnxruntime's Attention takes
    (it refuses a mask that broadcasts along T or S)."""
    shape = static_shape(m)
    scores = frame.lead + (frame.rows, frame.keys)
    if shape is None or len(shape) > len(scores) or np.broadcast_shapes(shape, scores) != scores:
        raise NotFused(f"mask {m.name} of shape {shape} does not broadcast to the scores {list(scores)}")
    ms = (1,) * (len(scores) - len(shape)) + tuple(shape)
    n_lead = len(frame.lead)
    batch_axes = 1 if n_lead >= 2 else 0
    bm = ms[0] if batch_axes else 1
    per_head = any(d != 1 for d in ms[batch_axes:n_lead]) or (fold > 1 and ms[-2] != 1)
    rows, keys = frame.rows // fold, frame.keys
    if per_head:  # spell out every head's (and folded row block's) rows, then read them as heads
        full = list(ms[:batch_axes]) + list(frame.lead[batch_axes:]) + [frame.rows if fold > 1 else ms[-2], ms[-1]]
        m = _expand(b, _reshape(b, m, ms), full)
        m = _reshape(b, m, [bm, frame.heads * fold, full[-2] // fold, ms[-1]])
        heads = frame.heads * fold
    else:
        m = _reshape(b, m, [bm, 1, ms[-2] if fold == 1 else 1, ms[-1]])
        heads = 1
    return _expand(b, m, [bm, heads, rows, keys])


def _reshape(b: Builder, x: ir.Value, shape) -> ir.Value:
    shape = [int(d) for d in shape]
    if list(static_shape(x)) == shape:
        return x
    return b.op("Reshape", [x, b.const(np.array(shape, np.int64), "shape")], shape, x.dtype)


def _expand(b: Builder, x: ir.Value, shape) -> ir.Value:
    shape = [int(d) for d in shape]
    if list(static_shape(x)) == shape:
        return x
    return b.op("Expand", [x, b.const(np.array(shape, np.int64), "shape")], shape, x.dtype)


def _bool_form(m: ir.Value):
    """An additive mask Where(c, 0, -big) is the boolean mask c (or Not c for Where(c, -big, 0))."""
    node = m.producer()
    if node is None or node.op_type != "Where":
        return None
    cond, a, c = node.inputs
    if scalar(a) == 0.0 and (scalar(c) or 0.0) <= VERY_NEGATIVE:
        return "keep", cond
    if scalar(c) == 0.0 and (scalar(a) or 0.0) <= VERY_NEGATIVE:
        return "drop", cond
    return None


def _keep(b: Builder, drop: ir.Value) -> ir.Value:
    node = drop.producer()
    if node is not None and node.op_type == "Not":
        return node.inputs[0]
    return b.op("Not", [drop], static_shape(drop), ir.DataType.BOOL)
