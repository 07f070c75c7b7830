"""fuse_attention: MatMul(Q, K^T) -> scale -> mask -> Softmax -> MatMul(., V)  ==>  one ONNX `Attention`.

The matched chain, walking up from each Softmax:

    scores = MatMul(Q', K'^T)            Q', K' any movement of Q, K (transposes, GQA repeat),
    [Mul | Div by a constant]            possibly scaled by constants on the way
    [Where(mask, s, -big) | Add(s, m)]   boolean or additive masks, in any order with the scale
    [Cast]  Softmax(axis=-1)  [Cast]     softmax in fp32 for fp16 models
    [Where(IsNaN(p), 0, p)]              torch's NaN guard after a boolean-masked SDPA
    out = MatMul(p, V')

K' and V' are traced back to their source tensors and the movement between is run on
element ids (see analysis.py): that reveals the GQA repeat, checks it is the
consecutive one (h0,h0,h1,h1) Attention implements, and leaves a plain reshape /
transpose from the source to the [B, Hkv, S, D] operand the fused op takes. The repeat
is dropped, not copied into the fused op. An `Attention` torch already emitted (SDPA at
opset >= 23) with such a repeat in front of its K/V gets the repeat removed the same way.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .analysis import as_view, chain_value, const, element_ids, group_repeat, scalar, static_shape, trace_movement
from .base import FusionPass, NotFused, Skip
from .build import Builder, replace_value

VERY_NEGATIVE = -1e4  # a fill at or below this is a mask, not arithmetic (finfo(fp16).min is -65504)


class FuseAttention(FusionPass):
    name = "fuse_attention"
    candidate_ops = ("Softmax", "Attention")

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        if node.op_type == "Attention":
            return self._drop_repeat(model, node)
        matmul_out = _probs_consumer(node)
        matmul_scores, masks, scale, fp32_softmax = _scores_chain(node.inputs[0])
        q_trace = trace_movement(matmul_scores.inputs[0], allow_scale=True)
        k_trace = trace_movement(matmul_scores.inputs[1], allow_scale=True)
        v_trace = trace_movement(matmul_out.inputs[1])
        q_ids, kt_ids, v_ids = (_ids(t, what) for t, what in ((q_trace, "Q"), (k_trace, "K^T"), (v_trace, "V")))
        if (q_ids.ndim, kt_ids.ndim, v_ids.ndim) != (4, 4, 4):
            raise NotFused(f"Q, K^T, V have ranks {q_ids.ndim}, {kt_ids.ndim}, {v_ids.ndim}; expected 4D [B, heads, S, D]")
        k_ids = kt_ids.swapaxes(-1, -2)
        heads = q_ids.shape[1]
        if k_ids.shape[1] != heads or v_ids.shape[1] != heads:
            raise NotFused(f"Q has {heads} heads but K/V reach the MatMuls with {k_ids.shape[1]}/{v_ids.shape[1]}")
        rep = math.gcd(group_repeat(k_ids), group_repeat(v_ids))
        b = Builder(model, matmul_out, f"{self.name}/{node.name}")
        q = _operand(b, q_trace, lambda ids: ids, "Q")
        k = _operand(b, k_trace, lambda ids: ids.swapaxes(-1, -2)[:, ::rep], "K")
        v = _operand(b, v_trace, lambda ids: ids[:, ::rep], "V")
        inputs = [q, k, v] + ([_mask(b, masks, q.dtype)] if masks else [])
        attrs = {"scale": float(scale * q_trace.scale * k_trace.scale)}
        if fp32_softmax and q.dtype != ir.DataType.FLOAT:
            attrs["softmax_precision"] = int(ir.DataType.FLOAT)
        out = matmul_out.outputs[0]
        fused = b.op("Attention", inputs, static_shape(out), out.dtype, **attrs)
        replace_value(out, fused)
        self._count_repeat(node, rep, k_ids)

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
        node.replace_input_with(1, _operand(b, k_trace, lambda ids: ids[:, ::rep], "K"))
        node.replace_input_with(2, _operand(b, v_trace, lambda ids: ids[:, ::rep], "V"))
        self._count_repeat(node, rep, k_ids)

    def _count_repeat(self, node: ir.Node, rep: int, k_ids: np.ndarray) -> None:
        if rep > 1:
            self.stats["repeat_removed"] += 1
        elif np.unique(k_ids).size < k_ids.size:
            self.stats["repeat_kept"] += 1
            self.note(node, "K/V heads are repeated in an order Attention cannot group (not h0,h0,h1,h1): "
                            "fused with the repeat kept")


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


def _scores_chain(x: ir.Value):
    """Walk up from the softmax input to MatMul(Q, K^T): (matmul, masks, scale, softmax_in_fp32)."""
    masks, scale, fp32 = [], 1.0, False
    while True:
        node = x.producer()
        if node is None:
            raise NotFused(f"scores come from graph input {x.name}; expected MatMul(Q, K^T)")
        op = node.op_type
        if op == "MatMul":
            return node, masks, scale, fp32
        if op == "Cast":
            fp32 |= node.attributes["to"].value == ir.DataType.FLOAT
            x = node.inputs[0]
        elif op in ("Mul", "Div") and _constant_side(node) is not None:
            i = _constant_side(node)
            c = scalar(node.inputs[i])
            if c is None or (op == "Div" and i == 0):
                raise NotFused(f"scores scaled by a non-scalar {node.inputs[i].name} in {op} ({node.name})")
            scale = scale * c if op == "Mul" else scale / c
            x = node.inputs[1 - i]
        elif op == "Add":
            a, m = _split_scores(node)
            if scale != 1.0:
                raise NotFused(f"additive mask {m.name} is added before the scores are scaled; expected it after")
            masks.append(("add", m))
            x = a
        elif op == "Where":
            cond, a, c = node.inputs
            fill_a, fill_c = scalar(a), scalar(c)
            if fill_c is not None and fill_a is None and fill_c <= VERY_NEGATIVE:
                masks.append(("keep", cond))
                x = a
            elif fill_a is not None and fill_c is None and fill_a <= VERY_NEGATIVE:
                masks.append(("drop", cond))
                x = c
            else:
                raise NotFused(f"Where ({node.name}) on the scores does not fill with a large negative constant")
        else:
            raise NotFused(f"scores pass through {op} ({node.name}); expected Cast/Mul/Div/Add/Where back to MatMul(Q, K^T)")


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
        if node.op_type not in ("Cast", "Mul", "Div", "Add", "Where"):
            return False
        data = [v for v in node.inputs if v is not None and const(v) is None]
        if node.op_type == "Where":
            data = data[1:]
        data = [v for v in data if v.shape is not None and len(v.shape) == len(x.shape)]
        node = data[0].producer() if data else None
    return False


def _mask(b: Builder, masks: list, dtype: ir.DataType) -> ir.Value:
    """All masks as one attn_mask: boolean (True = attend) when they all are, else additive in `dtype`."""
    keep, add = [], []
    for kind, m in masks:
        if kind == "add":
            kind, m = _bool_form(m) or (kind, m)
        if kind == "add":
            add.append(m)
        else:
            keep.append(_keep(b, m) if kind == "drop" else m)
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
