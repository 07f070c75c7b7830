"""One external-data file for every graph of an export: each distinct weight stored once.

The whole model's graphs (two steps x four targets) hold the same weights, most of them
byte for byte: each tensor above a small size goes into `weights.data` once, at an offset
every graph that holds it points to (the ONNX external-data convention, which onnxruntime
and the onnx checker read). A tied lm_head whose graph holds a transposed copy of the
embedding (the exporter folds `x @ E^T` into a constant E^T) points back at the embedding
through a Transpose instead (onnxruntime folds it at load, or, not folding, runs its MatMul
with transB). The `ort` target's packed q/k/v and gate/up (pack_matmuls) are stored as
packed, beside the parts the other targets read: as a Concat of the parts, a runtime that
does not fold it (the export's checks over one shared mapping) computes every layer's pack
before the first layer runs (onnxruntime's order), 1.1 GB at 0.6B, at every step.
"""
from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import numpy as np
import onnx_ir as ir

NAME = "weights.data"
INLINE_BYTES = 1024  # smaller tensors stay in the graph file
ALIGN = 4096  # page-aligned offsets, so runtimes can map the file


class WeightsFile:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._file = open(self.folder / NAME, "wb")
        self._stored: dict[bytes, tuple[int, int]] = {}
        # The graphs of one export share their weight tensors (each target's graph is a clone of the traced one), so
        # a tensor seen before is found by identity, without hashing its bytes again (SmolLM2-135M: 540 MB a graph).
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tensor -> (offset, length)

    def externalize(self, model: ir.Model) -> None:
        """Point every large initializer of `model` at its bytes in the shared file (written on first sight)."""
        _share_transposes(model)
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < INLINE_BYTES or isinstance(tensor, ir.ExternalTensor):
                continue
            offset, length = self._place(tensor)
            value.const_value = ir.ExternalTensor(NAME, offset=offset, length=length, dtype=tensor.dtype,
                                                  shape=tensor.shape, name=value.name, base_dir=self.folder)
        self._file.flush()  # the graph is loaded and checked before the next one is written

    def _place(self, tensor) -> tuple[int, int]:
        """Where the tensor's bytes are in the file, written there on first sight of those bytes."""
        if tensor not in self._seen:  # held weakly: a graph's own tensors (quantized weights) go with the graph
            data = _buffer(tensor)
            key = hashlib.sha256(data).digest()
            if key not in self._stored:
                offset = -self._file.tell() % ALIGN + self._file.tell()
                self._file.write(b"\0" * (offset - self._file.tell()))
                self._file.write(data)
                self._stored[key] = (offset, len(data))
            self._seen[tensor] = self._stored[key]
        return self._seen[tensor]

    def close(self) -> int:
        """Flush the file; returns its size in bytes."""
        self._file.close()
        return (self.folder / NAME).stat().st_size


def _buffer(tensor) -> memoryview | bytes:
    """The tensor's bytes as the file stores them: its own buffer where it has one. tobytes() copied it, and the first
    graph's copy of a tied embedding was a 1.2 GB spike at 1.7B; 4-bit types are packed two to a byte by tobytes()."""
    if tensor.dtype == ir.DataType.STRING or tensor.dtype.bitwidth % 8:
        return tensor.tobytes()
    return memoryview(np.ascontiguousarray(tensor.numpy()).reshape(-1).view(np.uint8))


def _share_transposes(model: ir.Model) -> None:
    """An initializer that is exactly another's transpose becomes Transpose(that one); the one a Gather reads
    (the embedding table) stays as it is."""
    graph = model.graph
    matrices = [v for v in graph.initializers.values() if v.const_value is not None
                and len(v.const_value.shape) == 2 and v.const_value.nbytes >= INLINE_BYTES]
    by_shape = {}
    for v in matrices:
        by_shape.setdefault((v.const_value.dtype, tuple(v.const_value.shape)), []).append(v)
    replaced = set()
    for v in matrices:
        rows, cols = v.const_value.shape
        for source in by_shape.get((v.const_value.dtype, (cols, rows)), []):
            if source is v or id(source) in replaced or not v.uses() or _gathered(v) \
                    or not _transposed(v.const_value.numpy(), source.const_value.numpy()):
                continue
            replaced.add(id(v))
            node = ir.node("Transpose", [source], attributes={"perm": [1, 0]}, name=f"{v.name}/tied")
            node.outputs[0].name, node.outputs[0].shape, node.outputs[0].type = f"{v.name}/tied", v.shape, v.type
            graph.insert_before(_first_user(graph, v), node)
            v.replace_all_uses_with(node.outputs[0])
            graph.initializers.pop(v.name)
            break


def _first_user(graph: ir.Graph, value: ir.Value) -> ir.Node:
    """The first node in graph order that reads `value`: a Transpose put there runs where it is needed in a runtime
    that keeps the graph's order and does not fold it."""
    users = {id(user) for user, _ in value.uses()}
    return next(node for node in graph if id(node) in users)


def _transposed(a: np.ndarray, b: np.ndarray) -> bool:
    """a == b.T, a corner compared first: most candidate pairs (30 layers of square q and o projections) differ there,
    and a whole comparison of each pair cost seconds a graph."""
    return np.array_equal(a[:4, :4], b[:4, :4].T) and np.array_equal(a, b.T)


def _gathered(value: ir.Value) -> bool:
    return any(user.op_type == "Gather" and index == 0 for user, index in value.uses())
