"""Graphs with symbolic dims (TorchScript-era exports, dims named by the exporter) become static and fuse once
their dims are pinned; the report says what was pinned to what.

A dim the graph left unnamed (onnxscript's BART encoder test model declares input_ids [1, None]) is pinned by input
and axis, `--fix-dims input_ids.1=16`; left dynamic, fix_dims names that exact flag. Planted: pinning the wrong axis
(input_ids.0, the static batch) is refused, and a wrong axis that is dynamic too makes a graph that does not take the
length it was meant for, caught by the parity run.
"""
import collections
import json
import warnings

import onnx
import onnx.helper as oh
import onnx_ir as ir
import numpy as np
import pytest
import torch
from onnxscript.rewriter.models import _bart_encoder as bart

from models import build_model, preset
from models.contract import INPUTS, OUTPUTS, example_inputs
from passes.__main__ import main
from passes.fix_dims import FixDims, check_pins, default, dim_value, parse_pins, FixDimsError
from runtime.metrics import TOLERANCE, error
from test_static_fold import VOCAB, T, run, weights  # the same graph and seeded weights (tests/ is on sys.path)


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
    assert parse_pins("input_ids.1=16, input.1.0=2, seq=4") == {"input_ids.1": 16, "input.1.0": 2, "seq": 4}
    for bad, message in (("input_ids.x=3", "AXIS a non-negative integer"), ("input_ids.-1=3", "AXIS a non-negative"),
                         ("input_ids.1=-4", "positive integer, got -4"), ("a=1,a=2", "pinned twice")):
        with pytest.raises(FixDimsError, match=message):
            parse_pins(bad)


@pytest.fixture(scope="module")
def shipped_bart(tmp_path_factory):
    """onnxscript's BART encoder test model as it ships (input_ids [1, None], the length unnamed), with
    test_static_fold's seeded zero-mean weights (the module's uniform ones leave attention too little to change)."""
    path = tmp_path_factory.mktemp("bart") / "bart.onnx"
    onnx.save(bart.make_model(**weights()), str(path))
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert [(d.dim_value, d.dim_param) for d in dims] == [(1, ""), (0, "")]  # [1, None]: no name to pin
    return path


def _parity(pinned: ir.Model, original: ir.Model, shape=(1, T)) -> float:
    rng = np.random.default_rng(0)
    errs = [error(run(pinned, ids), run(original, ids)) for ids in (rng.integers(0, VOCAB, shape) for _ in range(3))]
    assert all(e["finite"] for e in errs)
    return max(e["max_rel"] for e in errs)


def test_unpinned_shipped_bart_names_the_flag(shipped_bart, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main([str(shipped_bart), str(out), "--target", "onnx", "--require-fusion", "--report", str(report)]) == 1
    printed = capsys.readouterr().out
    assert "fix_dims: nothing to do (247 -> 247 nodes) [left dynamic: input_ids.1 (unnamed); pin with --fix-dims " \
           "input_ids.1=VALUE]" in printed and "without a static shape" in printed and not out.exists()
    fix = json.loads(report.read_text())["passes"][0]
    assert fix["suggest"] == "--fix-dims input_ids.1=VALUE" and fix["left_dynamic"] == ["input_ids.1 (unnamed)"]
    assert fix["not_matched"][0]["reason"] == "dim 1 (unnamed) left symbolic; pin it with --fix-dims input_ids.1=VALUE"


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_pinned_shipped_bart_fuses_with_parity(shipped_bart, tmp_path, target, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main([str(shipped_bart), str(out), "--target", target, "--fix-dims", f"input_ids.1={T}", "--require-fusion",
                 "--report", str(report)]) == 0
    assert "fix_dims: 1 dims_pinned" in capsys.readouterr().out
    passes = json.loads(report.read_text())["passes"]
    assert passes[0]["pinned"] == {"input_ids.1": str(T)} and passes[0]["left_dynamic"] == []
    assert next(p for p in passes if p["pass"] == "fuse_attention")["stats"] == {"fused": 2, "unfused": 0}
    pinned = ir.load(str(out))
    assert list(pinned.graph.inputs[0].shape) == [1, T]
    ops = collections.Counter(n.op_type for n in pinned.graph)
    assert ops["Attention"] == 2 and ops["Softmax"] == 0 and "Shape" not in ops, ops
    # against the original, unpinned graph, run at that length in onnxruntime
    assert _parity(pinned, ir.load(str(shipped_bart))) <= TOLERANCE["fp32"]


@pytest.mark.parametrize("pin, message", [
    ("ids.1=16", "--fix-dims ids.1=16: the graph has no input named 'ids'; its inputs are ['input_ids']"),
    ("input_ids.2=16", "--fix-dims input_ids.2=16: axis 2 is out of range for input 'input_ids' of rank 2 (shape "
                       "[1, None], axes 0..1)"),
    # planted: the wrong axis, the static batch, is refused rather than pinned
    ("input_ids.0=16", "--fix-dims input_ids.0=16: axis 0 of input 'input_ids' is already static, 1 (shape [1, None]); "
                       "only a dynamic dim can be pinned"),
    ("seq=16", "--fix-dims seq: no input dim has that name; the graph's symbolic dims are none; its unnamed dynamic "
               "dims are pinned by input and axis: --fix-dims input_ids.1=VALUE"),
])
def test_bad_axis_pins_are_one_line_before_any_work(shipped_bart, tmp_path, pin, message, capsys):
    out = tmp_path / "out.onnx"
    assert main([str(shipped_bart), str(out), "--target", "onnx", "--fix-dims", pin]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {message}\n" and not out.exists()


@pytest.mark.parametrize("pin, message", [("input_ids.1=0", "VALUE must be a positive integer, got 0"),
                                          ("input_ids.1=-16", "VALUE must be a positive integer, got -16")])
def test_non_positive_pin_is_a_usage_error(shipped_bart, tmp_path, pin, message, capsys):
    out = tmp_path / "out.onnx"
    with pytest.raises(SystemExit) as exit_:
        main([str(shipped_bart), str(out), "--target", "onnx", "--fix-dims", pin])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1 and not out.exists()


def test_axis_pins_of_named_and_static_dims():
    """A named dim is pinned by its name (the refusal gives the flag); a static dim may be restated, not changed; the
    left-dynamic report names each dim's own flag."""
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["s0", None, 8])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["past + s0"])
    out = oh.make_tensor_value_info("n", onnx.TensorProto.INT64, None)
    graph = oh.make_graph([oh.make_node("Shape", ["x"], ["n"])], "g", [x, y], [out])
    model = ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)]))
    with pytest.raises(FixDimsError, match=r"axis 0 of input 'x' is the named dim 's0'; pin it by name: "
                                           r"--fix-dims s0=4$"):
        check_pins(model, {"x.0": 4})
    with pytest.raises(FixDimsError, match=r"named dim 'past \+ s0'; pin it by name: --fix-dims past=VALUE,s0=VALUE$"):
        check_pins(model, {"y.0": 4})
    check_pins(model, {"x.2": 8, "x.1": 3})
    p = FixDims({"x.2": 8})
    p(model)
    assert p.left == ["x.0 (s0)", "x.1 (unnamed)", "y.0 (past + s0)"]
    assert p.summary().endswith("pin with --fix-dims s0=VALUE,x.1=VALUE]")  # past has its default, 128
    p = FixDims({"s0": 2, "x.1": 3})
    p(model)
    assert [list(v.shape) for v in model.graph.inputs] == [[2, 3, 8], [130]] and p.left == []
    assert p.pinned == {"s0": "2", "past": "128 (default)", "x.1": "3"}


def test_a_dynamic_wrong_axis_is_caught_by_parity(tmp_path, capsys):
    """Planted: the same model declared [None, None], the length pinned on axis 0 and the batch on axis 1. It is a
    valid graph for [16, 1], so it is written; run at the length it was meant for ([1, 16]) it is refused."""
    model = bart.make_model(**weights())
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()
    src, out = tmp_path / "bart.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(src))
    assert main([str(src), str(out), "--target", "onnx", "--fix-dims", f"input_ids.0={T},input_ids.1=1"]) == 0
    wrong = ir.load(str(out))
    assert list(wrong.graph.inputs[0].shape) == [T, 1]
    with pytest.raises(Exception, match="(?i)invalid dimensions|INVALID_ARGUMENT"):
        _parity(wrong, ir.load(str(src)))
    assert main([str(src), str(out), "--target", "onnx", "--fix-dims", f"input_ids.0=1,input_ids.1={T}"]) == 0
    assert _parity(ir.load(str(out)), ir.load(str(src))) <= TOLERANCE["fp32"]
