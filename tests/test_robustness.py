"""The passes never crash and never write a graph that cannot run: a candidate (or a whole pass) that fails is
left as it was, with the reason; the command checks its output runs before writing it. Regression tests for the
failures found on held-out graphs."""
import copy

import onnx
import onnx_ir as ir
import torch

import passes.fuse_attention as fuse_attention
from corpus import Variant, cases, export_case, variant_case
from passes.__main__ import main
from passes.pipeline import run_pipeline
from passes.verify import compare
from runtime.metrics import error


def save_raw(case, path):
    ir.save(export_case(case), path)
    return path


def eager_error(case, path) -> float:
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    args = case.inputs(0, seed=1)
    got = session.run(None, {n: a.numpy() for n, a in zip(case.input_names, args)})[0]
    with torch.no_grad():
        want = copy.deepcopy(case.module).float()(*args)
    want = want[0] if isinstance(want, tuple) else want
    return error(got, want.numpy())["max_abs"]


def corpus_case(words):
    return next(c for c in cases(transformers=False) if words in c.name)


def test_grouped_query_rows_over_a_cache_lower_on_ort(tmp_path, capsys):
    """Was: raw onnxruntime INVALID_ARGUMENT from lower_gqa's mask check (it fed positions of rep*T rows)."""
    case = corpus_case("Q as [B, Hkv, rep*T, D]")
    raw = save_raw(case, tmp_path / "raw.onnx")
    assert main([str(raw), str(tmp_path / "out.onnx"), "--target", "ort", "--require-fusion"]) == 0
    out = capsys.readouterr().out
    assert "lower_gqa: 1 fused, 0 unfused, 1 over_cache" in out
    assert eager_error(case, tmp_path / "out.onnx") < 1e-4


def test_key_padding_mask_fuses_into_a_graph_that_runs(tmp_path, capsys):
    """Was: an Attention with a [B, 1, 1, S] mask that onnxruntime refuses at its first run, written with exit 0."""
    case = corpus_case("(1 - keep[:, None, None, :]) * -10000")
    raw = save_raw(case, tmp_path / "raw.onnx")
    for target in ("onnx", "ort"):
        out = tmp_path / f"{target}.onnx"
        assert main([str(raw), str(out), "--target", target, "--require-fusion"]) == 0
        attention = next(n for n in onnx.load(str(out)).graph.node if n.op_type == "Attention")
        assert attention.input[3]  # the mask goes in, in a shape the kernel takes
        assert eager_error(case, out) < 1e-4
    kept = [line for line in capsys.readouterr().out.splitlines() if line.startswith("not lowered: Attention")]
    assert len(kept) == 1 and "masks causally by position only" in kept[0]  # ort keeps Attention, and says why


def test_a_crashing_candidate_is_left_as_it_was(tmp_path, monkeypatch):
    case = variant_case(Variant("course"))
    raw = save_raw(case, tmp_path / "raw.onnx")

    def boom(*args):  # fails after the Q/K/V operands were built: those nodes must go again
        raise RuntimeError("boom")
    monkeypatch.setattr(fuse_attention, "_mask", boom)
    model = ir.load(raw)
    report = run_pipeline(model, "onnx")
    fuse = next(p for p in report["passes"] if p["pass"] == "fuse_attention")
    assert fuse["stats"] == {"fused": 0, "unfused": 1} and fuse["nodes_before"] == fuse["nodes_after"]
    assert fuse["not_matched"][0]["reason"] == "failed: RuntimeError: boom"
    assert all(r["ok"] for r in compare(str(raw), ir.serde.serialize_model(model).SerializeToString()).values())


def test_a_crashing_pass_is_undone(tmp_path, monkeypatch, capsys):
    case = variant_case(Variant("course"))
    raw = save_raw(case, tmp_path / "raw.onnx")
    from passes.fuse_rope import FuseRoPE

    def wreck(self, model):  # half-rewrites the graph, then dies
        model.graph.remove(next(n for n in model.graph if n.op_type == "Softmax"), safe=False)
        raise KeyError("half done")
    monkeypatch.setattr(FuseRoPE, "run", wreck)
    assert main([str(raw), str(tmp_path / "out.onnx"), "--target", "onnx", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "fuse_rope: not applied, failed: KeyError: 'half done'" in out
    assert "fuse_attention: 1 fused" in out


def test_a_graph_that_does_not_run_is_not_written(tmp_path, monkeypatch, capsys):
    case = corpus_case("(1 - keep[:, None, None, :]) * -10000")
    raw = save_raw(case, tmp_path / "raw.onnx")
    monkeypatch.setattr(fuse_attention, "_canonical_mask", lambda b, m, frame, fold: m)  # the old, unrunnable mask
    assert main([str(raw), str(tmp_path / "out.onnx"), "--target", "onnx"]) == 1
    err = capsys.readouterr().err
    assert "the rewritten graph does not run in onnxruntime" in err and "though its input does" in err
    assert err.count("\n") == 1 and not (tmp_path / "out.onnx").exists()
    assert main([str(raw), str(tmp_path / "out.onnx"), "--target", "onnx", "--no-run-check"]) == 0  # on request


def test_output_is_checked_before_any_work(tmp_path, capsys):
    case = variant_case(Variant("course"))
    raw = save_raw(case, tmp_path / "raw.onnx")
    assert main([str(raw), str(tmp_path / "missing" / "out.onnx"), "--target", "ort"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "folder" in captured.err and "does not exist" in captured.err
    assert main([str(raw), str(tmp_path), "--target", "ort"]) == 1
    assert "is a folder" in capsys.readouterr().err


def test_cleanup_keeps_a_tiny_epsilon():
    """onnxscript's add_0 rule matches |c| <= 1e-8 and deleted Helium's RMSNorm epsilon (1e-8): a zero row divided
    by zero. Cleanup keeps it, and the graph stays finite on a zero row."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from passes.cleanup import Cleanup
    eps = helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-8])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["ms"], keepdims=1),
         helper.make_node("Add", ["ms", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["rms"]),
         helper.make_node("Div", ["x", "rms"], ["y"])],
        "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [eps])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    Cleanup()(model)
    assert [n.op_type for n in model.graph].count("Add") == 1
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.isfinite(session.run(None, {"x": np.zeros((1, 4), np.float32)})[0]).all()
    onnx.checker.check_model(ir.serde.serialize_model(model))
