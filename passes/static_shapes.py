"""Static-shape check: every tensor of a graph has fixed, positive dims after ONNX shape inference."""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx


class StaticShapeError(ValueError):
    """A tensor whose shape is unknown, symbolic or not positive."""


def _dims(value: onnx.ValueInfoProto) -> list | None:
    t = value.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]


def unknown_dims(path: str | Path, strict: bool = True) -> tuple[list[str], int]:
    """Shape inference with data propagation on the file: (tensors without fixed positive dims, tensors checked).

    `strict=False` is for graphs with onnxruntime contrib ops, which ONNX's inference does not
    know: their outputs keep the shapes the passes recorded, and those are checked.
    """
    with tempfile.TemporaryDirectory() as tmp:
        inferred = Path(tmp) / "inferred.onnx"
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred), check_type=strict, strict_mode=strict, data_prop=True)
        model = onnx.load(str(inferred), load_external_data=False)
    g = model.graph
    known = {v.name: _dims(v) for v in list(g.input) + list(g.output) + list(g.value_info)}
    names = [i.name for i in g.input] + [o for n in g.node for o in n.output if o]
    bad = []
    for name in names:
        dims = known.get(name)
        if dims is None or not all(isinstance(d, int) and d > 0 for d in dims):
            bad.append(f"{name}: {dims if dims is not None else 'unknown shape'}")
    return bad, len(names)


def check_static(path: str | Path, strict: bool = True) -> int:
    """Raise StaticShapeError unless every tensor is static; return the tensor count checked."""
    bad, count = unknown_dims(path, strict)
    if bad:
        raise StaticShapeError(f"{path}: {len(bad)} tensor(s) without fixed positive dims, e.g. {bad[:3]}; expected all static")
    return count
