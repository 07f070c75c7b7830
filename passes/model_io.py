"""Loading and saving ONNX files: a clear error for what is not a model, atomic writes for what is."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a file at 2 GiB; stay well clear of it
# onnxruntime contrib ops that live in the default domain (onnxruntime's choice), unknown to onnx.checker.
ORT_DEFAULT_DOMAIN_OPS = {"SimplifiedLayerNormalization"}
# Attributes onnx.checker does not range-check but onnx's shape inference (run by the passes' constant folding)
# indexes with unchecked, killing the process (found by the fuzzer: GatherND batch_dims=-2 is a SIGSEGV).
ATTRIBUTE_MINIMUM = {("GatherND", "batch_dims"): 0}


class ModelFileError(ValueError):
    """A path that does not hold a readable ONNX model, or cannot take one."""


def load(path: str | Path, map_weights: bool = False) -> ir.Model:
    """The model in `path`, checked. `map_weights`: its external weights stay in their file, mapped when first read,
    rather than read into memory with the graph (lint of a whole model's npu graph held 3x its weights that way)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"input {path}: not found; expected an ONNX file")
    if path.stat().st_size == 0:
        raise ModelFileError(f"input {path}: empty file; expected an ONNX model")
    try:
        if map_weights:
            model = ir.load(path)
            _check_external_data(model)
            light = structure(model)
            check(light)
        else:
            proto = onnx.load(str(path))
            check(proto)
            model = ir.serde.deserialize_model(proto)
            light = structure(model)
        check_shapes(light)
        return model
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelFileError(f"input {path}: not a valid ONNX model ({first[:160]})") from None


def structure(model: ir.Model) -> onnx.ModelProto:
    """The model as a protobuf without its weights (each large initializer a graph input of its type and shape in its
    place): what onnx.checker reads of the nodes, with no 2 GiB protobuf limit and no copy of the weights."""
    light = model.clone()
    for name, value in list(light.graph.initializers.items()):
        if value.const_value is not None and (value.const_value.nbytes > 1024
                                              or isinstance(value.const_value, ir.ExternalTensor)):
            light.graph.initializers.pop(name)
            value.const_value = None
            light.graph.inputs.append(value)
    return ir.serde.serialize_model(light)


def _check_external_data(model: ir.Model) -> None:
    """Each external initializer's bytes are in its file: what onnx.load finds out when it reads them."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            file = Path(tensor.base_dir) / tensor.location
            if not file.is_file() or file.stat().st_size < (tensor.offset or 0) + (tensor.length or 0):
                raise ValueError(f"the data of {value.name} is not in {tensor.location}")


def check(proto: onnx.ModelProto) -> None:
    """onnx.checker, with onnxruntime's default-domain contrib ops checked like any custom-domain op."""
    if any(n.op_type in ORT_DEFAULT_DOMAIN_OPS and n.domain in ("", "ai.onnx") for n in proto.graph.node):
        proto = onnx.ModelProto.FromString(proto.SerializeToString())
        for n in proto.graph.node:
            if n.op_type in ORT_DEFAULT_DOMAIN_OPS and n.domain in ("", "ai.onnx"):
                n.domain = "com.microsoft"
        if not any(o.domain == "com.microsoft" for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    onnx.checker.check_model(proto)
    _check_attribute_ranges(proto.graph)


def check_shapes(proto: onnx.ModelProto) -> None:
    """onnx's strict shape and type inference: a graph whose declared shapes or types contradict its ops (a MatMul of
    incompatible dims, an output declared [1, 2, 64] that its ScatterElements makes [1, 2, 2]) is not a model
    onnxruntime loads, and a rewrite of it has nothing to be held to."""
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)


def _check_attribute_ranges(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        for a in node.attribute:
            least = ATTRIBUTE_MINIMUM.get((node.op_type, a.name))
            if least is not None and a.i < least:
                raise ValueError(f"node {node.name or node.op_type}: {node.op_type} {a.name}={a.i}; expected >= {least}")
            for g in [a.g] * (a.type == onnx.AttributeProto.GRAPH) + list(a.graphs):
                _check_attribute_ranges(g)


def save(model: ir.Model, path: Path) -> str | None:
    """Save to `path` (weights to `<file>.data` beside it when large); returns the data file's name."""
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    data = f"{path.name}.data" if weight_bytes > EXTERNAL_DATA_BYTES else None
    ir.save(model, path, external_data=data)
    return data


def check_writable(path: str | Path, what: str = "output") -> None:
    """Fail now, before any work, if `path` cannot be written as a file."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ModelFileError(f"{what} {path}: folder {path.parent} does not exist; expected an existing folder")
    if path.is_dir():
        raise ModelFileError(f"{what} {path}: is a folder; expected a file path")
    if not os.access(path.parent, os.W_OK):
        raise ModelFileError(f"{what} {path}: folder {path.parent} cannot be written; expected a writable folder")


def save_atomic(model: ir.Model, path: str | Path) -> None:
    """Write beside `path` under a temporary name, then rename: `path` is the old file or the whole new one."""
    path = Path(path)
    check_writable(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    except OSError as e:
        raise ModelFileError(f"output {path}: folder cannot be written ({e.strerror}); expected a writable folder") from None
    try:
        staged = tmp / path.name
        data = save(model, staged)
        for name in ([data] if data else []) + [path.name]:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp / name, path.parent / name)
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
