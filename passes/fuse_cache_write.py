"""fuse_cache_write: a scatter of the new K/V rows into the cache  ==>  ONNX `TensorScatter`.

Matches ScatterElements (torch `scatter`) and ScatterND (`index_copy`, `index_put`, slice
assignment) whose indices are computed from the positions input. What the scatter
writes is established by running its index subgraph for sample positions: every update
row t of batch b must land on cache row p0_b + t, all else in place. Only then is it
replaced by TensorScatter(past, update, write_indices = positions[:, 0], axis = seq).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import attr, evaluator, position_source, sample_positions, static_shape
from .base import FusionPass, NotFused
from .build import Builder, replace_value


class FuseCacheWrite(FusionPass):
    name = "fuse_cache_write"
    candidate_ops = ("ScatterElements", "ScatterND")

    def run(self, model: ir.Model) -> bool:
        self._write_index = {}  # one positions[:, 0] per positions input, shared by the K and V writes
        return super().run(model)

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        data, indices, update = node.inputs[:3]
        if node.attributes.get("reduction") is not None and node.attributes["reduction"].value != "none":
            raise NotFused(f"scatter with reduction={node.attributes['reduction'].value}; expected a plain write")
        frame_upd = static_shape(update)
        past, perm = _cache_frame(data)
        cache = static_shape(past)
        if cache is None or frame_upd is None or len(cache) != len(frame_upd) or len(cache) < 2:
            raise NotFused(f"cache {cache} and update {frame_upd} are not static tensors of one rank")
        inv = tuple(int(i) for i in np.argsort(perm))
        upd = tuple(frame_upd[i] for i in inv)  # the update seen in the cache's own layout
        pos = position_source(indices, "scatter indices", NotFused)
        batch, length = static_shape(pos)
        axis = _seq_axis(node, perm, cache, upd, length)
        if cache[0] != batch or upd[0] != batch:
            raise NotFused(f"cache batch {cache[0]} / update batch {upd[0]} differ from positions batch {batch}")
        try:
            run = evaluator(model, [pos], [indices])
        except ValueError as e:
            raise NotFused(f"scatter indices cannot be evaluated from {pos.name} alone ({e})") from None
        for sample in sample_positions(batch, length, cache[axis], pos.dtype.numpy()):
            (idx,) = run([sample])
            dest = _destinations(node.op_type, idx, node, frame_upd)
            if dest is not None:  # into the cache's layout: permute the coordinates, then the update's axes
                dest = dest[..., list(inv)].transpose(*inv, len(inv))
            if dest is None or not np.array_equal(dest, _expected(sample, upd, axis)):
                raise NotFused(f"scatter does not write update row t to cache row position[b, t] along axis {axis}")
        b = Builder(model, node, f"{self.name}/{node.name}")
        if id(pos) not in self._write_index:
            first = b.op("Gather", [pos, b.const(np.array(0, np.int64), "zero")], [batch], pos.dtype, axis=1)
            if pos.dtype != ir.DataType.INT64:
                first = b.op("Cast", [first], [batch], ir.DataType.INT64, to=int(ir.DataType.INT64))
            self._write_index[id(pos)] = first
        written = b.op("TensorScatter", [past, b.view(update, frame_upd, inv), self._write_index[id(pos)]],
                       cache, past.dtype, axis=axis)
        replace_value(node.outputs[0], b.view(written, cache, perm))


def _cache_frame(data: ir.Value) -> tuple[ir.Value, tuple[int, ...]]:
    """(cache, perm) with data == cache.transpose(perm): torch scatters index_copy along axis 0 of a transposed cache."""
    perm, value = list(range(len(data.shape or ()))), data
    while (node := value.producer()) is not None and node.op_type == "Transpose":
        perm = [attr(node, "perm")[i] for i in perm]
        value = node.inputs[0]
    return value, tuple(perm)


def _seq_axis(node: ir.Node, perm, cache, upd, length: int) -> int:
    """The cache axis the rows are written along, in the cache's own layout."""
    if node.op_type == "ScatterElements":
        frame_axis = node.attributes["axis"].value % len(cache) if "axis" in node.attributes else 0
        axis = perm[frame_axis]
    else:
        differing = [a for a in range(1, len(cache)) if cache[a] != upd[a]]
        if len(differing) != 1:
            raise NotFused(f"cannot tell the sequence axis of cache {cache} from update {upd}")
        axis = differing[0]
    if upd[axis] != length or any(cache[a] != upd[a] for a in range(len(cache)) if a != axis):
        raise NotFused(f"update {upd} is not the cache {cache} with {length} rows along axis {axis}")
    return axis


def _destinations(op: str, idx: np.ndarray, node: ir.Node, upd) -> np.ndarray | None:
    """For every update element, the cache coordinates it is written to: [*upd, rank]."""
    coords = np.stack(np.meshgrid(*[np.arange(n) for n in upd], indexing="ij"), axis=-1)
    if op == "ScatterElements":
        if tuple(idx.shape) != tuple(upd):
            return None
        axis = node.attributes["axis"].value % len(upd) if "axis" in node.attributes else 0
        coords[..., axis] = idx
        return coords
    k = idx.shape[-1]
    if idx.ndim - 1 != k or tuple(idx.shape[:-1]) != tuple(upd[:k]):
        return None  # the update is not laid out like the cache: not a row write we can express
    coords[..., :k] = idx.reshape(*idx.shape[:-1], *([1] * (len(upd) - k)), k)
    return coords


def _expected(positions: np.ndarray, upd, axis: int) -> np.ndarray:
    coords = np.stack(np.meshgrid(*[np.arange(n) for n in upd], indexing="ij"), axis=-1)
    shape = [1] * len(upd)
    shape[0], shape[axis] = upd[0], upd[axis]
    coords[..., axis] = np.broadcast_to(positions.reshape(shape), tuple(upd))
    return coords
