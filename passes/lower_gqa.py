"""lower_gqa: a fused `Attention` that GroupQueryAttention can express  ==>  com.microsoft.GroupQueryAttention.

GroupQueryAttention masks causally by position by itself: query i of batch b sees rows
0 .. seqlens_k[b] - T + 1 + i (only the last `local_window_size` of them when that is set).
Two graph shapes mean exactly that:

- over a static cache: K and V are TensorScatter writes at positions[:, 0] and the mask
  is `row <= positions[b, t]` (within a sliding window or not), checked by running the
  mask subgraph for sample positions. GQA then takes the new rows and the caches as
  past_key/past_value (one buffer for past and present in onnxruntime); seqlens_k =
  positions[:, -1] and total_sequence_length = max(positions[:, -1]) + 1 are computed in
  the graph;
- without a cache: T == S and the mask is the lower triangle (or a band of it, or
  is_causal), whether a constant or computed at run time from constants or positions
  alone (transformers builds it from arange and comparisons): it is evaluated.

Soft-capping carries over (GQA's `softcap`). Anything else stays a standard Attention,
which onnxruntime also runs: an encoder's self-attention (no mask, not causal, no cache) is
named as such first.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import attr, static_shape
from .base import FusionPass, NotFused
from .causal import cache_writes, causal_window, check_cache_writes
from .build import Builder, replace_value


# Checked before anything else: whatever else the op holds, this alone keeps it a standard Attention.
NOT_CAUSAL = ("not causal: no mask, is_causal=0 and no cache write (an encoder's bidirectional self-attention); "
              "GroupQueryAttention always masks causally, so it stays a standard Attention, which onnxruntime runs")


class LowerToGQA(FusionPass):
    name = "lower_gqa"
    candidate_ops = ("Attention",)

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is None and not attr(node, "is_causal", 0) and cache_writes(node) is None:
            raise NotFused(NOT_CAUSAL)
        _check_expressible(node, q, k, v)
        (batch, heads, length, dim), kv_heads = static_shape(q), static_shape(k)[1]
        b = Builder(model, node, f"{self.name}/{node.name}")
        writes = cache_writes(node)
        if writes:
            if batch > 1 and length > 1:
                raise NotFused(f"batch {batch} with T={length}: onnxruntime's GroupQueryAttention runs a chunk over a "
                               "non-empty cache only at batch 1")
            pos, window = check_cache_writes(model, writes, mask, batch, length, static_shape(k)[2], windowed=True)
            new_k, new_v, past_k, past_v = writes[0].inputs[1], writes[1].inputs[1], writes[0].inputs[0], writes[1].inputs[0]
            last = b.op("Gather", [pos, b.const(np.array(length - 1, np.int64), "last")], [batch], pos.dtype, axis=1)
            seqlens = b.op("Cast", [last], [batch], ir.DataType.INT32, to=int(ir.DataType.INT32))
            total = b.op("Add", [b.op("ReduceMax", [seqlens], [], ir.DataType.INT32, keepdims=0),
                                 b.const(np.array(1, np.int32), "one")], [], ir.DataType.INT32)
        else:
            window = _check_cache_free(model, node, mask, length, static_shape(k)[2], [x.producer() for x in (k, v)])
            new_k, new_v, past_k, past_v = k, v, None, None
            seqlens = b.const(np.full([batch], length - 1, np.int32), "seqlens_k")
            total = b.const(np.array(length, np.int32), "total_sequence_length")
        packed = [_to_bsh(b, x) for x in (q, new_k, new_v)]
        cache = static_shape(past_k) if past_k is not None else [batch, kv_heads, length, dim]
        extra = {"softcap": float(attr(node, "softcap"))} if attr(node, "softcap", 0.0) else {}
        if window:
            extra["local_window_size"] = window
        out, present_k, present_v = b.op(
            "GroupQueryAttention", packed + [past_k, past_v, seqlens, total], None, None, domain="com.microsoft",
            num_outputs=3, shapes=[[batch, length, heads * dim], cache, cache], dtypes=[q.dtype] * 3,
            num_heads=heads, kv_num_heads=kv_heads, scale=float(attr(node, "scale", dim ** -0.5)), **extra)
        heads_first = b.op("Transpose", [b.op("Reshape", [out, b.const(np.array([batch, length, heads, dim], np.int64), "shape")],
                                              [batch, length, heads, dim], q.dtype)],
                           [batch, heads, length, dim], q.dtype, perm=[0, 2, 1, 3])
        replace_value(node.outputs[0], heads_first)
        if past_k is not None:
            replace_value(k, present_k)
            replace_value(v, present_v)
        model.opset_imports.setdefault("com.microsoft", 1)
        self.stats["over_cache" if past_k is not None else "cache_free"] += 1


def _to_bsh(b: Builder, x: ir.Value) -> ir.Value:
    """[B, heads, T, D] -> [B, T, heads * D], the layout GroupQueryAttention reads."""
    batch, heads, length, dim = static_shape(x)
    moved = b.op("Transpose", [x], [batch, length, heads, dim], x.dtype, perm=[0, 2, 1, 3])
    return b.op("Reshape", [moved, b.const(np.array([batch, length, heads * dim], np.int64), "shape")],
                [batch, length, heads * dim], x.dtype)


def _check_expressible(node: ir.Node, q: ir.Value, k: ir.Value, v: ir.Value) -> None:
    if len(node.inputs) > 4 and any(x is not None for x in node.inputs[4:]):
        raise NotFused("Attention has past_key/past_value/nonpad_kv_seqlen inputs; expected K/V as whole tensors")
    if any(o is not None and (o.uses() or o.is_graph_output()) for o in node.outputs[1:]):
        raise NotFused("Attention's present or QK^T outputs are used; GroupQueryAttention has no equivalent")
    shapes = [static_shape(x) for x in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes):
        raise NotFused(f"Q/K/V shapes {shapes}; expected static [B, heads, S, D]")
    dim = shapes[0][3]
    if dim % 8 or shapes[1][3] != dim or shapes[2][3] != dim:
        raise NotFused(f"head sizes Q {dim}, K {shapes[1][3]}, V {shapes[2][3]}: onnxruntime's GroupQueryAttention "
                       "needs them equal and a multiple of 8")
    if q.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        raise NotFused(f"dtype {q.dtype}; GroupQueryAttention runs float32 and float16")


def _check_cache_free(model: ir.Model, node: ir.Node, mask, length: int, kv_length: int, writes) -> int:
    """The sliding window (0: none) of a causal attention without a cache, or NotFused."""
    if any(w is not None and w.op_type == "TensorScatter" for w in writes):
        raise NotFused("only one of K and V is a TensorScatter cache write")
    if kv_length != length:
        raise NotFused(f"K/V have {kv_length} rows for {length} queries and no cache write: not a causal prefill")
    if mask is None:
        if not attr(node, "is_causal", 0):
            raise NotFused(NOT_CAUSAL)
        return 0
    return causal_window(model, mask, length)
