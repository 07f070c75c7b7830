"""Graphs with symbolic dims (TorchScript-era exports, dims named by the exporter) become static and fuse once
their dims are pinned; the report says what was pinned to what."""
import json
import warnings

import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
import torch

from models import build_model, preset
from models.contract import INPUTS, OUTPUTS, example_inputs
from passes.__main__ import main
from passes.fix_dims import FixDims, default, dim_value, parse_pins, FixDimsError


@pytest.fixture(scope="module")
def torchscript_step(tmp_path_factory):
    """The course's step exported by the TorchScript exporter at opset 17, batch and sequence dynamic."""
    config = preset("tiny")
    path = tmp_path_factory.mktemp("ts") / "step.onnx"
    dynamic = {"hidden_states": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"},
               "past_key": {0: "batch"}, "past_value": {0: "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(build_model(config), example_inputs(config, 16), str(path), dynamo=False, opset_version=17,
                          input_names=list(INPUTS), output_names=list(OUTPUTS), dynamic_axes=dynamic)
    assert any(n.op_type == "Shape" for n in onnx.load(str(path)).graph.node)  # shape arithmetic to fold
    return path


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_torchscript_graph_fuses_after_fix_dims(torchscript_step, tmp_path, target, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main([str(torchscript_step), str(out), "--target", target, "--require-fusion"]) == 1  # seq=128 > C=64
    capsys.readouterr()
    assert main([str(torchscript_step), str(out), "--target", target, "--fix-dims", "seq=16", "--require-fusion",
                 "--verify", "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "[batch=1 (default), seq=16]" in printed
    assert json.loads(report.read_text())["passes"][0]["pinned"] == {"batch": "1 (default)", "seq": "16"}
    model = onnx.load(str(out))
    assert [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input][:2] == [[1, 16, 64], [1, 16]]
    ops = {n.op_type for n in model.graph.node}
    assert {"GroupQueryAttention" if target == "ort" else "Attention"} <= ops and "Shape" not in ops


def test_fix_dims_errors_come_before_any_work(torchscript_step, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main([str(torchscript_step), str(out), "--target", "onnx", "--fix-dims", "sequence=16"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no input dim has that name" in captured.err and "['batch', 'seq']" in captured.err
    with pytest.raises(SystemExit) as exit_:
        main([str(torchscript_step), str(out), "--target", "onnx", "--fix-dims", "seq=abc"])
    assert exit_.value.code == 2 and "expected NAME=VALUE" in capsys.readouterr().err


def test_optimum_style_dim_expressions():
    """Hand-written with the ONNX helper: a decoder-with-past's names, total length as an expression."""
    past = oh.make_tensor_value_info("past_key", onnx.TensorProto.FLOAT, ["batch_size", 2, "past_sequence_length", 8])
    mask = oh.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64,
                                     ["batch_size", "past_sequence_length + sequence_length"])
    ids = oh.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch_size", "sequence_length"])
    out = oh.make_tensor_value_info("n", onnx.TensorProto.INT64, None)
    graph = oh.make_graph([oh.make_node("Shape", ["attention_mask"], ["n"])], "g", [ids, past, mask], [out])
    model = ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)]))
    p = FixDims({"sequence_length": 1})
    p(model)
    assert [list(v.shape) for v in model.graph.inputs] == [[1, 1], [1, 2, 128, 8], [1, 129]]
    assert p.pinned == {"batch_size": "1 (default)", "sequence_length": "1", "past_sequence_length": "128 (default)"}


def test_dim_names_and_expressions():
    assert [default(n, ["past_len", "total"]) for n in ("batch_size", "past_len", "seq", "total", "s0")] == \
        [1, 128, 128, 256, None]
    assert dim_value("past + 1", {"past": 7}) == 8 and dim_value("2*s0 - 1", {"s0": 3}) == 5
    assert dim_value("past + x", {"past": 7}) is None and dim_value("__import__('os')", {}) is None
    assert parse_pins("a=1, b=2") == {"a": 1, "b": 2}
    with pytest.raises(FixDimsError, match="positive integer"):
        parse_pins("a=0")
