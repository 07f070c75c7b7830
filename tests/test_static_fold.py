"""Shape arithmetic over static shapes is folded, so a graph whose inputs are already static fuses without --fix-dims.

The graph is onnxscript's own BART encoder test model (onnxscript/rewriter/models/_bart_encoder.py: two layers of
bidirectional self-attention, E=16, 4 heads of 4), which declares input_ids [1, None]; pinned to [1, 16] as its test
feeds it, its Q/K/V reshapes were computed from Shape/Gather/Concat and from torch's expand arithmetic
(ConstantOfShape -> Mul -> Equal -> Where into Expand), and fuse_attention refused them ("Q comes from ... without a
static shape"). Weights are seeded and zero-mean here (the module's own are uniform in [0, 1), which leaves so little
for attention to change that a 10% wrong scale moves the output by 5e-5, under the fp32 budget).

Planted faults: the same graph with its length left dynamic is not folded to any one length (it still runs at two
lengths, equal to its input), and a wrong fold (the position table folded one row off) is caught by parity.
"""
import collections

import numpy as np
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnxscript.rewriter.models import _bart_encoder as bart

from passes.cleanup import Cleanup
from passes.pipeline import run_pipeline
from runtime.metrics import TOLERANCE, error

T, E, FF, VOCAB, POSITIONS = 16, 16, 4, 1024, 102
OFFSET = 2  # BART's learned positions start at row 2
SHAPE_OPS = {"Shape", "ConstantOfShape", "Gather", "Concat", "Unsqueeze", "Slice", "Expand", "Range", "Where"}


def weights(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = lambda *shape, s=0.5: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    w = {"encoder_embed_tokens_weight": n(VOCAB, E, s=1.0), "encoder_embed_positions_weight": n(POSITIONS, E, s=1.0),
         "encoder_layers_0_self_attn_k_proj_bias": n(E, s=0.1),
         "encoder_layers_0_self_attn_layer_norm_weight": (1 + n(E, s=0.1)).astype(np.float32),
         "encoder_layers_0_fc1_bias": n(FF, s=0.1)}
    for layer in ((257, 267, 268, 270, 271, 272, 273), (283, 284, 286, 287, 288)):
        for i in layer:
            shape = {271: (E, FF), 287: (E, FF), 272: (FF, E), 288: (FF, E)}.get(i, (E, E))
            w[f"matmul_{i}"] = n(*shape)
    return w


def encoder(static: bool = True) -> ir.Model:
    model = ir.serde.deserialize_model(bart.make_model(**weights()))
    if static:
        model.graph.inputs[0].shape = ir.Shape([1, T])
    return model


def run(model: ir.Model, ids: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # its own fusions apart
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


def parity(before: ir.Model, after: ir.Model, length: int = T) -> float:
    rng = np.random.default_rng(length)
    errs = [error(run(after, ids), run(before, ids)) for ids in (rng.integers(0, VOCAB, (1, length)) for _ in range(3))]
    assert all(e["finite"] for e in errs)
    return max(e["max_rel"] for e in errs)


@pytest.fixture(scope="module")
def fused():
    out = {}
    for target in ("onnx", "ort", "npu"):
        model = encoder()
        out[target] = (model, run_pipeline(model, target))
    return out


def passes(report: dict, name: str) -> list[dict]:
    return [p for p in report["passes"] if p["pass"] == name]


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_static_encoder_fuses_one_attention_per_layer_with_parity(fused, target):
    model, report = fused[target]
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Attention"] == 2 and ops["Softmax"] == 0, ops  # one per layer
    assert not {"Shape", "ConstantOfShape", "Expand", "Range"} & set(ops), ops  # the shape arithmetic is gone
    assert passes(report, "cleanup")[0]["stats"]["shape_ops_removed"] == 10
    assert passes(report, "fuse_attention")[0]["stats"] == {"fused": 2, "unfused": 0}
    assert parity(encoder(), model) <= TOLERANCE["fp32"]


def test_encoder_attention_stays_standard_on_ort_and_says_why(fused):
    """GroupQueryAttention always masks causally: the encoder's two Attention ops stay standard, named as such."""
    _, report = fused["ort"]
    lower = passes(report, "lower_gqa")[0]
    assert lower["stats"] == {"fused": 0, "unfused": 2}
    assert all(n["reason"].startswith("not causal: no mask, is_causal=0 and no cache write") for n in lower["not_matched"])


def test_npu_refuses_the_encoder_in_one_line(fused):
    model, report = fused["npu"]
    lower = passes(report, "lower_npu")[0]
    assert lower["stats"] == {"not_applied": 1}
    reason = lower["not_matched"][0]["reason"]
    assert "not a step-contract graph" in reason and "2 Attention op(s) without a cache write" in reason
    assert collections.Counter(n.op_type for n in model.graph)["Attention"] == 2  # left as the onnx target's


def test_dynamic_length_is_not_folded():
    """Planted: input_ids [1, None]. Nothing may be folded to one length: Shape ops stay, attention is refused for
    the reason it was, and the rewritten graph still runs at any length, equal to its input."""
    model = encoder(static=False)
    report = run_pipeline(model, "onnx")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Softmax"] == 2 and ops["Attention"] == 0, ops
    # what reads the length stays: Shape(input_ids) and torch's expand of the positions over it
    assert ops["Shape"] >= 1 and ops["Range"] == ops["Where"] == ops["Expand"] == 1, ops
    assert all("without a static shape" in n["reason"] for n in passes(report, "fuse_attention")[0]["not_matched"])
    for length in (7, T):
        assert parity(encoder(static=False), model, length) <= TOLERANCE["fp32"]


def test_a_wrong_fold_is_caught_by_parity(fused):
    """The position embeddings are folded to a constant (rows 2..17 of the table); folded one row off, parity fails."""
    model, _ = fused["onnx"]
    table = weights()["encoder_embed_positions_weight"]
    folded = [v for v in model.graph.initializers.values() if v.const_value.shape == ir.Shape([1, T, E])]
    assert len(folded) == 1 and np.array_equal(folded[0].const_value.numpy()[0], table[OFFSET:OFFSET + T])
    wrong = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    value = wrong.graph.initializers[folded[0].name]
    value.const_value = ir.tensor(table[None, OFFSET - 1:OFFSET - 1 + T], name=value.name)
    assert parity(encoder(), wrong) > 100 * TOLERANCE["fp32"]


def test_only_shape_vectors_of_constant_of_shape_are_folded():
    """An integer ConstantOfShape of a constant rank is shape arithmetic and folds; a float fill (a mask, a zero
    cache) is kept, and so is one whose shape comes from a dynamic input."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])
    d = oh.make_tensor_value_info("d", TensorProto.FLOAT, ["n", 3])
    outs = [oh.make_tensor_value_info(n, t, None) for n, t in (("v", TensorProto.INT64), ("y", TensorProto.FLOAT),
                                                               ("z", TensorProto.INT64))]
    one = oh.make_tensor("one", TensorProto.INT64, [1], [1])
    nodes = [oh.make_node("Constant", [], ["rank"], value=oh.make_tensor("r", TensorProto.INT64, [1], [4])),
             oh.make_node("ConstantOfShape", ["rank"], ["ones"], value=one),
             oh.make_node("Mul", ["ones", "ones"], ["v"]),
             oh.make_node("Constant", [], ["big"], value=oh.make_tensor("b", TensorProto.INT64, [2], [4, 64])),
             oh.make_node("ConstantOfShape", ["big"], ["fill"]),
             oh.make_node("Add", ["x", "fill"], ["y"]),
             oh.make_node("Shape", ["d"], ["sd"]),
             oh.make_node("ConstantOfShape", ["sd"], ["z"], value=one)]
    model = ir.serde.deserialize_model(oh.make_model(oh.make_graph(nodes, "g", [x, d], outs),
                                                     opset_imports=[oh.make_opsetid("", 20)]))
    Cleanup()(model)
    kept = [(n.op_type, n.outputs[0].name) for n in model.graph if n.op_type in ("ConstantOfShape", "Shape")]
    assert kept == [("ConstantOfShape", "fill"), ("Shape", "sd"), ("ConstantOfShape", "z")], kept
    assert model.graph.outputs[0].const_value is not None and list(model.graph.outputs[0].const_value.numpy()) == [1] * 4
