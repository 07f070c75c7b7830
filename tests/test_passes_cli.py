"""python -m passes: statistics, report, --require-fusion, --verify, and bad input."""
import hashlib
import json

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from passes.__main__ import main
from passes.verify import compare


@pytest.fixture(scope="module")
def raw(exported):
    return exported().folder / "decode.raw.onnx"


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ort_target_with_every_check(raw, tmp_path, capsys):
    before = sha(raw)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main([str(raw), str(out), "--target", "ort", "--report", str(report), "--require-fusion", "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "fuse_attention: 1 fused, 0 unfused, 1 repeat_removed" in "\n".join(lines)
    assert any(line.startswith("lower_gqa: 1 fused, 0 unfused") for line in lines)
    assert lines[-2].startswith("verify: output max abs") and lines[-1] == f"wrote {out}"
    r = json.loads(report.read_text())
    assert [p["pass"] for p in r["passes"]] == ["fix_dims", "cleanup", "upgrade_opset", "einsum_to_matmul", "fuse_rmsnorm",
                                                "fuse_rope", "fuse_attention", "fuse_cache_write", "cleanup", "lower_gqa",
                                                "cleanup", "fold_rope_gqa", "pack_matmuls", "pack_qkv", "cleanup"]
    assert r["unfused"] == [] and r["fused_ops"] == 1 and all(v["ok"] for v in r["verify"].values())
    ops = {n.op_type: n for n in onnx.load(str(out)).graph.node}
    assert set(ops) >= {"GroupQueryAttention", "SimplifiedLayerNormalization", "Split"} and "RotaryEmbedding" not in ops
    assert {a.name: a.i for a in ops["GroupQueryAttention"].attribute}["do_rotary"] == 1  # tiny: D = 16
    assert sha(raw) == before  # the input is never modified
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "report.json"]  # no temp files left


def test_require_fusion_names_what_is_left(raw, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main([str(raw), str(out), "--target", "raw", "--require-fusion"]) == 1
    captured = capsys.readouterr()
    assert "unfused: Softmax node_softmax: fuse_attention did not run on this target" in captured.out
    assert "left unfused (--require-fusion)" in captured.err and not out.exists()


def relu_model(path):
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])
    model = oh.make_model(oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 10  # what this onnxruntime reads
    onnx.save(model, path)


def test_no_attention_is_nothing_to_fuse(tmp_path, capsys):
    relu_model(tmp_path / "relu.onnx")
    assert main([str(tmp_path / "relu.onnx"), str(tmp_path / "a.onnx"), "--target", "onnx", "--verify"]) == 0
    assert "nothing to fuse" in capsys.readouterr().out
    assert main([str(tmp_path / "relu.onnx"), str(tmp_path / "b.onnx"), "--target", "onnx", "--require-fusion"]) == 1
    assert "no attention to fuse" in capsys.readouterr().err and not (tmp_path / "b.onnx").exists()


def test_dump_after_every_pass(raw, tmp_path):
    assert main([str(raw), str(tmp_path / "o.onnx"), "--target", "onnx", "--dump-dir", str(tmp_path / "dump")]) == 0
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == [
        "00-fix_dims.onnx", "01-cleanup.onnx", "02-upgrade_opset.onnx", "03-einsum_to_matmul.onnx",
        "04-fuse_rmsnorm.onnx", "05-fuse_rope.onnx", "06-fuse_attention.onnx", "07-fuse_cache_write.onnx",
        "08-cleanup.onnx"]


@pytest.mark.parametrize("content, message", [
    (None, "not found; expected an ONNX file"),
    (b"", "empty file; expected an ONNX model"),
    (b"this is not protobuf at all \xff\xfe", "not a valid ONNX model"),
    ("truncated", "not a valid ONNX model"),
    ("an output's declared shape contradicts its op", "not a valid ONNX model ([ShapeInferenceError]"),
])
def test_bad_input_files(raw, tmp_path, capsys, content, message):
    path = tmp_path / "in.onnx"
    if content == "truncated":
        path.write_bytes(raw.read_bytes()[: raw.stat().st_size // 3])
    elif content == "an output's declared shape contradicts its op":  # onnxruntime would not load it
        model = onnx.load(str(raw))
        model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value += 1
        onnx.save(model, str(path))
    elif content is not None:
        path.write_bytes(content)
    assert main([str(path), str(tmp_path / "out.onnx"), "--target", "ort"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: input {path}: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out.onnx").exists()


def test_output_folder_missing(raw, tmp_path, capsys):
    assert main([str(raw), str(tmp_path / "nope" / "out.onnx"), "--target", "onnx"]) == 1
    assert "folder" in capsys.readouterr().err and not (tmp_path / "nope").exists()


def test_verify_catches_a_changed_graph(raw, tmp_path):
    model = onnx.load(str(raw))
    weight = next(i for i in model.graph.initializer if i.name == model.graph.node[-1].input[1])  # o_proj
    array = onnx.numpy_helper.to_array(weight) + np.float32(0.01)
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    results = compare(str(raw), model.SerializeToString())
    assert not results["output"]["ok"] and results["output"]["max_abs"] > 1e-3
    assert results["output"]["why"].startswith("max_rel") and results["output"]["tolerance"] == 1e-4
    assert results["present_value"]["ok"] or results["present_key"]["ok"]


def test_npu_target_from_the_cli(raw, tmp_path, capsys):
    out = tmp_path / "npu.onnx"
    assert main([str(raw), str(out), "--target", "npu", "--require-fusion"]) == 0
    assert "lower_npu: 1 attention, 2 rope, 2 rmsnorm" in capsys.readouterr().out
    from passes.lint import lint
    assert lint(out, "npu") == []
    assert main([str(raw), str(tmp_path / "v.onnx"), "--target", "npu", "--verify"]) == 1
    assert "npu target changes the step's inputs and outputs" in capsys.readouterr().err
