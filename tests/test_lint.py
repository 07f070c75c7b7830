"""python -m passes.lint: each rule fires on a graph that breaks it, and the targets lint clean."""
import json

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto as TP

from passes.lint import lint, main

X = oh.make_tensor_value_info("x", TP.FLOAT, [1, 4])
Y = oh.make_tensor_value_info("y", TP.FLOAT, [1, 4])


def save(tmp_path, nodes, inputs=(X,), outputs=(Y,), opset=17, initializers=(), extra_opsets=()):
    model = oh.make_model(oh.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers)),
                          opset_imports=[oh.make_opsetid("", opset), *extra_opsets])
    model.ir_version = 10
    path = tmp_path / "g.onnx"
    onnx.save(model, path)
    return path


def const(name, array):
    return onnx.numpy_helper.from_array(np.asarray(array), name)


def rules(path, profile="npu"):
    return {v.rule for v in lint(path, profile)}


def test_clean_graph_passes(tmp_path, capsys):
    path = save(tmp_path, [oh.make_node("Relu", ["x"], ["y"])])
    assert lint(path, "npu") == []
    assert main([str(path), "--profile", "npu"]) == 0
    assert "0 violation(s)" in capsys.readouterr().out


@pytest.mark.parametrize("rule, build", [
    ("opset", lambda p: save(p, [oh.make_node("Relu", ["x"], ["y"])], opset=18)),
    ("static-shape", lambda p: save(p, [oh.make_node("Relu", ["x"], ["y"])],
                                    inputs=[oh.make_tensor_value_info("x", TP.FLOAT, ["batch", 4])],
                                    outputs=[oh.make_tensor_value_info("y", TP.FLOAT, ["batch", 4])])),
    ("control-flow", lambda p: save(p, [oh.make_node("If", ["c"], ["y"], then_branch=_branch(1.0), else_branch=_branch(2.0))],
                                    inputs=[oh.make_tensor_value_info("c", TP.BOOL, [])])),
    ("shape-op", lambda p: save(p, [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Reshape", ["x", "s"], ["y"])])),
    ("computed-reshape", lambda p: save(p, [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Reshape", ["x", "s"], ["y"])])),
    ("scatter", lambda p: save(p, [oh.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=1)],
                               initializers=[const("i", np.zeros((1, 1), np.int64)), const("u", np.ones((1, 1), np.float32))])),
    ("repeat", lambda p: save(p, [oh.make_node("Expand", ["x", "s"], ["y"])], initializers=[const("s", np.array([1, 4]))])),
    ("int32-inputs", lambda p: save(p, [oh.make_node("Cast", ["i"], ["y"], to=TP.FLOAT)],
                                    inputs=[oh.make_tensor_value_info("i", TP.INT64, [1, 4])])),
    ("finite-constants", lambda p: save(p, [oh.make_node("Add", ["x", "m"], ["y"])],
                                        initializers=[const("m", np.array([0, -np.inf, 0, 0], np.float32))])),
    ("standard-domain", lambda p: save(p, [oh.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")],
                                       extra_opsets=[oh.make_opsetid("com.microsoft", 1)])),
    ("no-bool-inputs", lambda p: save(p, [oh.make_node("Where", ["m", "x", "x"], ["y"])],
                                      inputs=[X, oh.make_tensor_value_info("m", TP.BOOL, [1, 4])])),
])
def test_each_npu_rule_fires(tmp_path, rule, build):
    assert rule in rules(build(tmp_path))


def test_qnn_note_on_float_tables_gathered_by_positions(tmp_path, capsys):
    """A note, not a violation: QNN's HTP compiles it, with fp16 precision on."""
    path = save(tmp_path, [oh.make_node("Gather", ["table", "pos"], ["y"], axis=0)],
                inputs=[oh.make_tensor_value_info("pos", TP.INT32, [1])],
                outputs=[oh.make_tensor_value_info("y", TP.FLOAT, [1, 4])],
                initializers=[const("table", np.zeros((8, 4), np.float32))])
    assert lint(path, "npu") == [] and [n.rule for n in lint(path, "npu", notes=True)] == ["qnn-fp16-precision"]
    assert main([str(path), "--profile", "npu"]) == 0
    assert "note: qnn-fp16-precision" in capsys.readouterr().out


def _branch(value):
    out = oh.make_tensor_value_info("b", TP.FLOAT, [1, 4])
    return oh.make_graph([oh.make_node("Constant", [], ["b"], value=onnx.numpy_helper.from_array(
        np.full((1, 4), value, np.float32)))], "branch", [], [out])


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_targets_lint_clean_and_raw_does_not(exported, target, tmp_path, capsys):
    art = exported()
    for step in ("prefill", "decode"):
        assert lint(art.folder / f"{step}.{target}.onnx", target) == []
    raw = art.folder / "decode.raw.onnx"
    assert main([str(raw), "--profile", target, "--json", str(tmp_path / "r.json")]) == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert "attention-fused" in {v["rule"] for v in report["violations"]}
    assert "attention-fused: node_softmax (Softmax)" in capsys.readouterr().out


def test_bad_file_is_one_line(tmp_path, capsys):
    (tmp_path / "x.onnx").write_bytes(b"nope")
    assert main([str(tmp_path / "x.onnx"), "--profile", "npu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: input") and err.count("\n") == 1
