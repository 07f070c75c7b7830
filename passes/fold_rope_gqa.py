"""fold_rope_gqa: RotaryEmbedding on Q and K right before GroupQueryAttention  ==>  GQA with do_rotary=1.

GroupQueryAttention rotates the new Q and K rows itself at positions seqlens_k - T + 1 + i,
which are the step's positions when they are consecutive (the step contract; the
runtime rejects anything else). Folded only when both rotations use the same cos/sin
tables and the same form (halves, or interleaved pairs: GQA's rotary_interleaved), over the
whole head, at the positions GQA derives its own from, and the head size is a multiple of
16 (onnxruntime's rotary kernel).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import MOVEMENT_OPS, attr, const, graph_input_ancestors, static_shape
from .base import FusionPass, NotFused, Skip


class FoldRoPEIntoGQA(FusionPass):
    name = "fold_rope_gqa"
    candidate_ops = ("GroupQueryAttention",)
    domain = "com.microsoft"

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        if attr(node, "do_rotary", 0):
            raise Skip
        ropes = [x.producer() for x in node.inputs[:2]]
        if any(r is None or (r.domain, r.op_type) != ("com.microsoft", "RotaryEmbedding") for r in ropes):
            if not any(_rotated_in_part(x) for x in node.inputs[:2]):
                raise Skip  # a layer without RoPE (SmolLM3's, EXAONE-4's NoPE layers): nothing to fold
            raise NotFused("Q and K do not both come straight from a RotaryEmbedding (a partial rotary, rotating "
                           "only the leading dims of each head, is not folded)")
        rq, rk = ropes
        if any(attr(r, "rotary_embedding_dim", 0) or attr(r, "scale", 1.0) != 1.0 for r in ropes):
            raise NotFused("RotaryEmbedding is partial or scaled")
        interleaved = attr(rq, "interleaved", 0)
        if attr(rk, "interleaved", 0) != interleaved:
            raise NotFused("Q and K are rotated in different forms (one interleaved)")
        tables = [(const(r.inputs[2]), const(r.inputs[3])) for r in ropes]
        if any(t is None for pair in tables for t in pair) or not all(np.array_equal(a, b) for a, b in zip(*tables)):
            raise NotFused("Q and K are rotated with different or non-constant cos/sin tables")
        dim = static_shape(node.inputs[0])[-1] // attr(node, "num_heads")
        if dim % 16:
            raise NotFused(f"head size {dim}: onnxruntime's rotary inside GroupQueryAttention needs a multiple of 16")
        if rq.inputs[1] is not rk.inputs[1] or not _positions_match(node, rq.inputs[1]):
            raise NotFused("the rotations use other positions than the ones GroupQueryAttention derives")
        if any(len(r.outputs[0].uses()) != 1 for r in ropes):
            raise NotFused("a rotated Q or K is also used outside the attention")
        node.replace_input_with(0, rq.inputs[0])
        node.replace_input_with(1, rk.inputs[0])
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", interleaved)
        node.resize_inputs(9)  # inputs 7 and 8: cos_cache, sin_cache
        node.replace_input_with(7, rq.inputs[2])
        node.replace_input_with(8, rq.inputs[3])


def _rotated_in_part(value: ir.Value) -> bool:
    """Whether a RotaryEmbedding feeds `value` through data movement, slices and concats only (partial rotary:
    Concat(rotated leading dims, the rest))."""
    stack, seen = [value], set()
    while stack:
        node = stack.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "RotaryEmbedding":
            return True
        if node.op_type in MOVEMENT_OPS | {"Concat", "Slice", "Split"}:
            stack.extend(v for v in node.inputs if v is not None)
    return False


def _positions_match(gqa: ir.Node, positions: ir.Value) -> bool:
    """Over a cache: the same positions input seqlens_k comes from. Without one: 0..T-1, as seqlens_k = T-1 says."""
    seqlens = gqa.inputs[5]
    if const(seqlens) is None:
        return positions in graph_input_ancestors(seqlens)
    t = static_shape(positions)[1]
    p = const(positions)
    return p is not None and np.array_equal(p, np.broadcast_to(np.arange(t), p.shape)) \
        and bool(np.all(const(seqlens) == t - 1))
