"""Is a fused Attention causal by absolute position (within a sliding window or not)? Checked by evaluation.

Shared by the lowerings that replace the graph's own mask with one implied by positions
(GroupQueryAttention) or supplied by the host (npu).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import attr, const, evaluator, graph_input_ancestors, position_source, sample_positions, static_shape
from .base import NotFused


def cache_writes(node: ir.Node) -> list[ir.Node] | None:
    """The TensorScatter nodes writing the Attention's K and V, if both are."""
    writes = [x.producer() for x in node.inputs[1:3]]
    return writes if all(w is not None and w.op_type == "TensorScatter" for w in writes) else None


def check_cache_writes(model: ir.Model, writes: list[ir.Node], mask: ir.Value | None, batch: int, length: int,
                       capacity: int, windowed: bool = False) -> tuple[ir.Value, int]:
    """K and V rows are written at positions[:, 0] along axis 2, and the mask is exactly row <= position[b, t]
    (and, if `windowed`, position[b, t] - row < W for one W).

    Returns the positions input and the window (0: none).
    """
    if writes[0].inputs[2] is not writes[1].inputs[2] or any(attr(w, "mode", "linear") != "linear" for w in writes):
        raise NotFused("K and V caches are written at different indices or in circular mode")
    if any(attr(w, "axis", -2) % 4 != 2 for w in writes):
        raise NotFused("cache is not written along axis 2 of [B, Hkv, C, D]")
    if mask is None:
        raise NotFused("no mask: the lowered op masks causally by position, the graph does not")
    pos = position_source(writes[0].inputs[2], "cache write indices", NotFused)
    if static_shape(pos) != (batch, length):
        raise NotFused(f"positions {pos.name} are {list(static_shape(pos))}, not one per query [{batch}, {length}]")
    if position_source(mask, "attention mask", NotFused) is not pos:
        raise NotFused("the mask is computed from another input than the cache write positions")
    rows = np.arange(capacity)[None, None, None, :]
    samples = sample_positions(batch, length, capacity, pos.dtype.numpy())
    masks = _run(model, [pos], [mask], [[sample] for sample in samples])
    at = [sample[:, None, :, None] for sample in samples]
    window = band(masks, [rows <= a for a in at], [a - rows for a in at]) if windowed else 0
    for m, a in zip(masks, at):
        if not same_mask(m, (rows <= a) & ((a - rows < window) if window else True)):
            raise NotFused("the mask is not causal by absolute position (row <= position"
                           + (", within one sliding window)" if windowed else ")"))
    return pos, window


def causal_window(model: ir.Model, mask: ir.Value, length: int) -> int:
    """For attention without a cache (T queries over the same T keys): the sliding window W of a mask that is
    causal within it (0: plain causal), whatever the positions, else NotFused. The mask may be computed at run
    time from constants, or from one positions input, for which it is evaluated at sample positions."""
    sources = graph_input_ancestors(mask)
    samples = [[]]
    if sources:
        pos = sources[0]
        if len(sources) > 1 or pos.dtype not in (ir.DataType.INT64, ir.DataType.INT32) or \
                static_shape(pos) is None or len(pos.shape) != 2:
            named = ", ".join(f"{s.name} {list(s.shape or [])} {s.dtype}" for s in sources)
            raise NotFused(f"the mask depends on input(s) {named}, not on positions alone (a padding or other "
                           "run-time mask); GroupQueryAttention masks causally by position only")
        samples = [[(p0 + np.broadcast_to(np.arange(pos.shape[1]), static_shape(pos))).astype(pos.dtype.numpy())]
                   for p0 in (0, 1, 37)]
    i, j = np.arange(length)[:, None], np.arange(length)[None]
    masks = [const(mask)] if not sources and const(mask) is not None else _run(model, sources, [mask], samples)
    window = band(masks, [j <= i] * len(masks), [i - j] * len(masks))
    if not all(same_mask(m, (j <= i) & ((i - j < window) if window else True)) for m in masks):
        raise NotFused("the mask is not the causal lower triangle (or a band of it); GroupQueryAttention masks "
                       "causally by position only")
    return window


def band(masks: list[np.ndarray], causal: list[np.ndarray], distance: list[np.ndarray]) -> int:
    """The sliding window W (a query keeps keys at distance < W) that (boolean or additive) masks show, or 0 if
    they keep every causal key: a guess, which `same_mask` then checks."""
    widest, reach = 0, 0
    for m, c, d in zip(masks, causal, distance):
        keep = m if m.dtype == np.bool_ else m == 0
        try:
            shape = np.broadcast_shapes(keep.shape, c.shape)
        except ValueError:
            return 0  # not a mask over these queries and keys: the check that follows says no
        kept = np.broadcast_to(d, shape)[np.broadcast_to(keep, shape) & np.broadcast_to(c, shape)]
        widest = max(widest, int(kept.max()) + 1 if kept.size else 0)
        reach = max(reach, int(np.broadcast_to(d, shape)[np.broadcast_to(c, shape)].max()) + 1)
    return 0 if widest >= reach else widest


def _run(model: ir.Model, inputs, outputs, samples) -> list[np.ndarray]:
    """The mask for each sample's feeds."""
    try:
        run = evaluator(model, inputs, outputs)
        return [run(feeds)[0] for feeds in samples]
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise NotFused(f"the mask cannot be evaluated on its own ({first})") from None


def same_mask(mask: np.ndarray, want: np.ndarray) -> bool:
    """A boolean (True = attend) or additive (0 = attend, very negative elsewhere) mask equal to `want`."""
    if mask.dtype != np.bool_:
        if not np.all((mask == 0) | (mask <= -1e4)):
            return False
        mask = mask == 0
    if mask.ndim > 4:
        return False
    try:
        shape = np.broadcast_shapes(mask.shape, want.shape)
    except ValueError:
        return False
    return np.array_equal(np.broadcast_to(mask, shape), np.broadcast_to(want, shape))
