"""Is a fused Attention causal by absolute position over a cache it writes? Checked by evaluation.

Shared by the lowerings that replace the graph's own mask with one implied by positions
(GroupQueryAttention) or supplied by the host (npu).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import attr, evaluate, position_source, sample_positions
from .base import NotFused


def cache_writes(node: ir.Node) -> list[ir.Node] | None:
    """The TensorScatter nodes writing the Attention's K and V, if both are."""
    writes = [x.producer() for x in node.inputs[1:3]]
    return writes if all(w is not None and w.op_type == "TensorScatter" for w in writes) else None


def check_cache_writes(model: ir.Model, writes: list[ir.Node], mask: ir.Value | None, batch: int, length: int,
                       capacity: int) -> ir.Value:
    """K and V rows are written at positions[:, 0] along axis 2, and the mask is exactly row <= position[b, t].

    Returns the positions input.
    """
    if writes[0].inputs[2] is not writes[1].inputs[2] or any(attr(w, "mode", "linear") != "linear" for w in writes):
        raise NotFused("K and V caches are written at different indices or in circular mode")
    if any(attr(w, "axis", -2) % 4 != 2 for w in writes):
        raise NotFused("cache is not written along axis 2 of [B, Hkv, C, D]")
    if mask is None:
        raise NotFused("no mask: the lowered op masks causally by position, the graph does not")
    pos = position_source(writes[0].inputs[2], "cache write indices", NotFused)
    if position_source(mask, "attention mask", NotFused) is not pos:
        raise NotFused("the mask is computed from another input than the cache write positions")
    for sample in sample_positions(batch, length, capacity, pos.dtype.numpy()):
        (m,) = evaluate(model, [pos], [mask], [sample])
        want = np.arange(capacity)[None, None, None, :] <= sample[:, None, :, None]
        if not same_mask(m, want):
            raise NotFused("the mask is not causal by absolute position (row <= position)")
    return pos


def same_mask(mask: np.ndarray, want: np.ndarray) -> bool:
    """A boolean (True = attend) or additive (0 = attend, very negative elsewhere) mask equal to `want`."""
    if mask.dtype != np.bool_:
        if not np.all((mask == 0) | (mask <= -1e4)):
            return False
        mask = mask == 0
    if mask.ndim > 4:
        return False
    shape = np.broadcast_shapes(mask.shape, want.shape)
    return np.array_equal(np.broadcast_to(mask, shape), np.broadcast_to(want, shape))
