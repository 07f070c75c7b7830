"""lower_gqa: Attention over a TensorScatter-written cache  ==>  com.microsoft.GroupQueryAttention.

GroupQueryAttention writes the new K/V rows itself and masks causally by position:
query i of batch b sees rows 0 .. seqlens_k[b] - T + 1 + i. That equals the graph only
when the Attention's K and V are TensorScatter writes at positions[:, 0] and its mask
is exactly `row <= positions[b, t]`; the mask is checked by running its subgraph for
sample positions. Then seqlens_k = positions[:, -1] and total_sequence_length =
max(positions[:, -1]) + 1 are computed in the graph, and the caches pass through as
past_key/past_value, so onnxruntime can share one buffer for past and present.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import attr, evaluate, position_source, sample_positions, static_shape
from .base import FusionPass, NotFused
from .build import Builder, replace_value


class LowerToGQA(FusionPass):
    name = "lower_gqa"
    candidate_ops = ("Attention",)

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if len(node.inputs) > 4 and any(x is not None for x in node.inputs[4:]):
            raise NotFused("Attention has past_key/past_value/nonpad inputs; expected a TensorScatter-written cache")
        for name in ("is_causal", "softcap", "qk_matmul_output_mode"):
            if attr(node, name, 0):
                raise NotFused(f"Attention has {name}={attr(node, name)}; GroupQueryAttention has no equivalent here")
        writes = [x.producer() for x in (k, v)]
        if any(w is None or w.op_type != "TensorScatter" for w in writes):
            raise NotFused("K/V are not TensorScatter cache writes (a cache-free graph): kept as standard Attention")
        if writes[0].inputs[2] is not writes[1].inputs[2] or any(attr(w, "mode", "linear") != "linear" for w in writes):
            raise NotFused("K and V caches are written at different indices or in circular mode")
        (batch, heads, length, dim), (_, kv_heads, capacity, _) = static_shape(q), static_shape(k)
        if any(attr(w, "axis", -2) % 4 != 2 for w in writes):
            raise NotFused("cache is not written along axis 2 of [B, Hkv, C, D]")
        if dim % 8 or static_shape(v)[3] != dim:
            raise NotFused(f"head_dim {dim} (V {static_shape(v)[3]}): onnxruntime's GroupQueryAttention needs equal "
                           "Q/K/V head sizes that are multiples of 8")
        if batch > 1 and length > 1:
            raise NotFused(f"batch {batch} with T={length}: onnxruntime's GroupQueryAttention runs a chunk over a "
                           "non-empty cache only at batch 1")
        if q.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            raise NotFused(f"dtype {q.dtype}; GroupQueryAttention runs float32 and float16")
        if mask is None:
            raise NotFused("no mask: GroupQueryAttention always masks causally, the graph does not")
        pos = position_source(writes[0].inputs[2], "cache write indices", NotFused)
        _check_causal(model, mask, pos, capacity, length)

        b = Builder(model, node, f"{self.name}/{node.name}")
        packed = lambda x, h: b.op("Reshape", [b.op("Transpose", [x], [batch, length, h, dim], x.dtype, perm=[0, 2, 1, 3]),  # noqa: E731
                                               b.const(np.array([batch, length, h * dim], np.int64), "shape")],
                                   [batch, length, h * dim], x.dtype)
        last = b.op("Gather", [pos, b.const(np.array(length - 1, np.int64), "last")], [batch], pos.dtype, axis=1)
        seqlens = b.op("Cast", [last], [batch], ir.DataType.INT32, to=int(ir.DataType.INT32))
        total = b.op("Add", [b.op("ReduceMax", [seqlens], [], ir.DataType.INT32, keepdims=0),
                             b.const(np.array(1, np.int32), "one")], [], ir.DataType.INT32)
        cache = [batch, kv_heads, capacity, dim]
        out, present_k, present_v = b.op(
            "GroupQueryAttention",
            [packed(q, heads), packed(writes[0].inputs[1], kv_heads), packed(writes[1].inputs[1], kv_heads),
             writes[0].inputs[0], writes[1].inputs[0], seqlens, total],
            None, None, domain="com.microsoft", num_outputs=3,
            shapes=[[batch, length, heads * dim], cache, cache], dtypes=[q.dtype] * 3,
            num_heads=heads, kv_num_heads=kv_heads, scale=float(attr(node, "scale", dim ** -0.5)))
        heads_first = b.op("Transpose", [b.op("Reshape", [out, b.const(np.array([batch, length, heads, dim], np.int64), "shape")],
                                              [batch, length, heads, dim], q.dtype)],
                           [batch, heads, length, dim], q.dtype, perm=[0, 2, 1, 3])
        replace_value(node.outputs[0], heads_first)
        replace_value(writes[0].outputs[0], present_k)
        replace_value(writes[1].outputs[0], present_v)
        model.opset_imports.setdefault("com.microsoft", 1)


def _check_causal(model: ir.Model, mask: ir.Value, pos: ir.Value, capacity: int, length: int) -> None:
    """The mask must be True exactly where cache row <= position[b, t] (any broadcast over heads)."""
    if position_source(mask, "attention mask", NotFused) is not pos:
        raise NotFused("the mask is computed from another input than the cache write positions")
    batch = static_shape(pos)[0]
    for sample in sample_positions(batch, length, capacity, pos.dtype.numpy()):
        (m,) = evaluate(model, [pos], [mask], [sample])
        want = np.arange(capacity)[None, None, None, :] <= sample[:, None, :, None]
        if m.dtype != np.bool_:
            m = m == 0  # additive: 0 where visible, -big elsewhere
        if m.ndim > 4 or not np.array_equal(np.broadcast_to(m, np.broadcast_shapes(m.shape, want.shape)),
                                            np.broadcast_to(want, np.broadcast_shapes(m.shape, want.shape))):
            raise NotFused("the mask is not causal by absolute position (row <= position)")
