"""block_qdq_weights: a QDQ graph's per-channel int8 matmul weights, re-quantized from the float graph in blocks of 32."""
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.block_qdq_weights import BlockQDQWeights
from passes.lint import lint
from runtime.session import cpu_options

K, N, ROWS = 64, 24, 3


def _weight(k: int = K) -> np.ndarray:
    """A trained matrix's shape of trouble: one input row 40x the others, which a per-channel scale is set by."""
    w = np.random.default_rng(0).standard_normal((k, N)).astype(np.float32)
    w[5] *= 40
    return w


def _graphs(w: np.ndarray, extra_reader: bool = False) -> tuple[ir.Model, ir.Model]:
    """(float graph: x @ w, the same graph in QDQ form with w per channel), the MatMul named alike in both."""
    k = w.shape[0]
    scale = np.abs(w).max(0) / 127
    codes = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, N])
    floats = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "f", [x], [y],
                               [numpy_helper.from_array(w, "w")])
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="dq", axis=1),
             helper.make_node("MatMul", ["x", "w_dq"], ["y"], name="proj")]
    outputs = [y]
    if extra_reader:  # the dequantized weight read as something other than a matmul weight too
        nodes.append(helper.make_node("Relu", ["w_dq"], ["w_relu"], name="relu"))
        outputs.append(helper.make_tensor_value_info("w_relu", TensorProto.FLOAT, [k, N]))
    qdq = helper.make_graph(nodes, "q", [x], outputs, [numpy_helper.from_array(codes, "w_q"),
                                                       numpy_helper.from_array(scale.astype(np.float32), "w_s"),
                                                       numpy_helper.from_array(np.zeros(N, np.int8), "w_z")])
    make = lambda g: ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]))
    return make(floats), make(qdq)


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, cpu_options(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]


def test_blocks_hold_a_weight_a_channel_scale_cannot():
    """The outlier row sets each channel's scale 40x too coarse for the other rows; a scale per 32 rows holds the rows
    of the other block. The product is checked against the float one (x @ w), not against the pass's own arithmetic."""
    w = _weight()
    floats, model = _graphs(w)
    x = np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32)
    x[:, :32] = 0  # the inputs of the outlier's block off: what is left is what the other block's codes carry
    before = np.abs(_run(model, x) - x @ w).max()
    p = BlockQDQWeights(floats)
    assert p(model).modified and p.stats["blocked"] == 1 and p.notes == []
    dq = next(n for n in model.graph if n.op_type == "DequantizeLinear")
    assert (dq.attributes.get_int("axis"), dq.attributes.get_int("block_size")) == (0, 32)
    assert dq.inputs[1].const_value.shape == (K // 32, N) and dq.inputs[0].dtype == ir.DataType.INT8
    after = np.abs(_run(model, x) - x @ w).max()
    print(f"max |error| of x @ w over the other block: per channel {before:.2e}, blocks of 32 {after:.2e}")
    assert after < before / 10


def test_blocked_weights_pass_lint_and_a_bad_block_is_refused(tmp_path):
    floats, model = _graphs(_weight())
    BlockQDQWeights(floats)(model)
    good = tmp_path / "good.onnx"
    ir.save(model, good)
    assert [v for v in lint(good, "npu") if v.rule == "qdq-weights"] == []
    dq = next(n for n in model.graph if n.op_type == "DequantizeLinear")
    for axis, block in ((1, 32), (0, 6)):  # planted: blocks along N; a block QNN's HTP cannot take for 8 bits
        dq.attributes["axis"], dq.attributes["block_size"] = ir.AttrInt64("axis", axis), ir.AttrInt64("block_size", block)
        bad = tmp_path / f"bad{axis}{block}.onnx"
        onnx.save(ir.serde.serialize_model(model), bad)
        found = [v for v in lint(bad, "npu") if v.rule == "qdq-weights"]
        assert len(found) == 1 and f"in blocks of {block} along axis {axis}" in found[0].message, found


@pytest.mark.parametrize("case, reason", [
    ("k", "kept per channel: K = 40 is not a multiple of 32"),
    ("reader", "kept per channel: not read as a MatMul weight alone"),
    ("name", "kept per channel: no float weight for proj in the float graph"),
])
def test_a_weight_blocks_cannot_hold_is_kept_per_channel_and_said_why(case, reason):
    floats, model = _graphs(_weight(40 if case == "k" else K), extra_reader=case == "reader")
    if case == "name":
        next(n for n in floats.graph if n.op_type == "MatMul").name = "other"
    p = BlockQDQWeights(floats)
    assert not p(model).modified and p.stats["blocked"] == 0
    assert [n["reason"] for n in p.notes] == [reason]
    dq = next(n for n in model.graph if n.op_type == "DequantizeLinear")
    assert dq.attributes.get_int("axis") == 1 and "block_size" not in dq.attributes
