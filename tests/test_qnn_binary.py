"""Weight-shared QNN context binaries: compiled by onnxruntime-qnn, read back by QNN's own libQnnSystem."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime import qnn
from runtime.qnn_binary import BinaryError, binary_info, check_wrapper, data_type

E = 256


def _graph(path, rows: int, weight: np.ndarray) -> None:
    """x [1, rows, E] @ weight -> Relu: two of these with different rows are a prefill and a decode reading one weight."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, E])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows, E])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, f"step{rows}", [x], [y], [numpy_helper.from_array(weight, "w")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, path)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("steps")
    weight = np.random.default_rng(0).standard_normal((E, E)).astype(np.float32)
    paths = [folder / "prefill.onnx", folder / "decode.onnx"]
    for path, rows in zip(paths, (8, 1)):
        _graph(path, rows, weight)
    return paths


def test_one_binary_holds_every_graph_and_their_weights_once(steps, tmp_path):
    shared = qnn.compile_shared(steps, 57, [tmp_path / "prefill.qnn57.onnx", tmp_path / "decode.qnn57.onnx"],
                                "steps.bin", [True, True])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.qnn57.onnx", "prefill.qnn57.onnx", "steps.bin"]
    info = binary_info(tmp_path / shared["binary"])
    assert info["soc_model"] == 57 and len(info["graphs"]) == 2
    shapes = sorted(g["inputs"][0]["shape"] for g in info["graphs"])
    assert shapes == [[1, 1, E], [1, 8, E]]
    assert all(g["inputs"][0]["dtype"] == "float32" and g["outputs"][0]["name"] == "y" for g in info["graphs"])
    # each graph alone embeds its own copy of the weight (E*E in fp16 on the HTP); shared, the two hold one
    alone = [qnn.compile_shared([s], 57, [tmp_path / s.stem / "alone.onnx"], "alone.bin", [True])["bytes"]
             for s in steps if (tmp_path / s.stem).mkdir() is None]
    assert shared["bytes"] < 0.7 * sum(alone), (shared["bytes"], alone)
    assert shared["bytes"] > 2 * E * E  # the weight is in it


def test_a_truncated_or_foreign_binary_is_refused_with_its_name(steps, tmp_path):
    shared = qnn.compile_shared(steps, 57, [tmp_path / "a.onnx", tmp_path / "b.onnx"], "ab.bin", [True, True])
    data = (tmp_path / shared["binary"]).read_bytes()
    (tmp_path / "truncated.bin").write_bytes(data[: len(data) // 2])
    for bad in (tmp_path / "truncated.bin", steps[0], tmp_path / "missing.bin"):
        with pytest.raises(BinaryError, match=bad.name):
            binary_info(bad)


def test_data_type_names():
    assert [data_type(c) for c in (0x0232, 0x0216, 0x0032, 0x0416, 0x0308, 0x0508, 0x0226, 0x7FFFFFFF)] == \
        ["float32", "float16", "int32", "ufixed16", "sfixed8", "bool8", "bfloat16", "0x7fffffff"]


def test_a_wrapper_is_checked_against_its_source_graph(steps, tmp_path):
    wrappers = [tmp_path / "prefill.qnn57.onnx", tmp_path / "decode.qnn57.onnx"]
    shared = qnn.compile_shared(steps, 57, wrappers, "steps.bin", [True, True])
    for wrapper, source in zip(wrappers, steps):
        assert check_wrapper(wrapper, source)["binary"] == shared["binary"]
    # planted: the decode wrapper names the prefill's graph (another step's shapes, as another window's would be)
    decode = onnx.load(wrappers[1])
    other = onnx.load(wrappers[0]).graph.node[0]
    names = {a.name: a for a in other.attribute}
    for a in decode.graph.node[0].attribute:
        if a.name == "partition_name":
            a.CopyFrom(names["partition_name"])
    onnx.save(decode, tmp_path / "swapped.onnx")
    with pytest.raises(BinaryError, match="are not decode.onnx's"):
        check_wrapper(tmp_path / "swapped.onnx", steps[1])
    # planted: a graph the binary does not hold
    for a in decode.graph.node[0].attribute:
        if a.name == "partition_name":
            a.s = b"QNNExecutionProvider_QNNExecutionProvider_0_1_0"
    onnx.save(decode, tmp_path / "missing.onnx")
    with pytest.raises(BinaryError, match="does not hold"):
        check_wrapper(tmp_path / "missing.onnx", steps[1])
    # planted: the binary truncated
    binary = tmp_path / shared["binary"]
    binary.write_bytes(binary.read_bytes()[:1000])
    with pytest.raises(BinaryError, match=shared["binary"]):
        check_wrapper(wrappers[1], steps[1])
