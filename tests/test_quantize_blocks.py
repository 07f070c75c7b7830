"""quantize_blocks (the int4 scheme): weights on a Q4_1 grid are held exactly, the lm_head goes to int8, and a graph
that drops the blocks' minimum is caught."""
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.quantize_blocks import BLOCK, QuantizeBlocks, output_projection, q4_blocks, q8_blocks
from runtime.metrics import error

K, N, V = 96, 80, 112


def q41_weights(rng, k=K, n=N) -> np.ndarray:
    """A [K, N] matrix as a Q4_1 GGUF stores it: per block of 32 along K, fp16 scale d and minimum m, w = m + d * q."""
    d = rng.uniform(1e-3, 1e-2, (n, k // BLOCK, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.1, 0.0, (n, k // BLOCK, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, k // BLOCK, BLOCK))
    q[..., 0], q[..., 1] = 0, 15  # every block spans its whole grid, as Q4_1's own rounding leaves it
    return (m + d * q).astype(np.float32).reshape(n, k).T.copy()


def _unpack4(codes):
    return np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1).astype(np.float64)


def test_q4_blocks_hold_a_q41_grid_exactly():
    w = q41_weights(np.random.default_rng(0))
    codes, d, rest = q4_blocks(w)
    back = (d[..., None] * (_unpack4(codes) - 8) + rest.T[..., None]).reshape(N, K).T
    assert np.abs(back - w).max() <= 1e-7 * np.abs(w).max()


@pytest.mark.parametrize("quantize", [q4_blocks, q8_blocks])
def test_blocks_quantized_a_slice_of_columns_at_a_time_are_the_whole_matrixs(monkeypatch, quantize):
    """The lm_head is quantized in slices of columns to bound memory: 7 columns a slice (80 = 11 x 7 + 3) must give
    every code and scale the whole matrix at once gives."""
    w = np.random.default_rng(3).standard_normal((K, N)).astype(np.float32)
    monkeypatch.setattr("passes.quantize_blocks.COLUMN_ELEMENTS", K * N)
    whole = quantize(w)
    monkeypatch.setattr("passes.quantize_blocks.COLUMN_ELEMENTS", K * 7)
    sliced = quantize(w)
    assert [a.shape for a in sliced] == [a.shape for a in whole]
    for a, b in zip(sliced, whole):
        np.testing.assert_array_equal(a, b)


def test_q8_blocks_hold_a_q80_grid_exactly():
    rng = np.random.default_rng(1)
    d = rng.uniform(1e-3, 1e-2, (N, K // BLOCK, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (N, K // BLOCK, BLOCK))
    q[..., 0] = 127
    w = (d * q).astype(np.float32).reshape(N, K).T.copy()
    codes, scale = q8_blocks(w)
    back = (scale[..., None] * (codes.astype(np.float64) - 128)).reshape(N, K).T
    assert np.abs(back - w).max() <= 1e-7 * np.abs(w).max()


def _lm_graph(rng, rows: int, softcap: bool):
    """x [1, rows, K] -> MatMul(W1) -> Relu -> MatMul(W2) -> (30 * tanh(s / 30)) -> logits [1, rows, V]."""
    w1, w2 = q41_weights(rng, K, K), q41_weights(rng, K, V)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["s" if softcap else "logits"])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    if softcap:
        nodes += [helper.make_node("Div", ["s", "cap"], ["a"]), helper.make_node("Tanh", ["a"], ["b"]),
                  helper.make_node("Mul", ["b", "cap"], ["logits"])]
        inits.append(numpy_helper.from_array(np.array(30.0, np.float32), "cap"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, rows, V])], inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    return ir.serde.deserialize_model(model)


def _run(model, x):
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("rows", [1, 5])  # one row: the blocks' share goes in as MatMulNBits' bias; more: an Add
@pytest.mark.parametrize("softcap", [False, True])
def test_the_pass_computes_the_fp32_product_of_q41_weights(rows, softcap):
    rng = np.random.default_rng(2)
    model, x = _lm_graph(rng, rows, softcap), rng.standard_normal((1, rows, K)).astype(np.float32)
    want = _run(model, x)
    assert output_projection(model).inputs[1].name == "w2"
    p = QuantizeBlocks(4, accuracy_level=0)  # fp32 compute: what is left is the representation's error alone
    p(model)
    assert p.stats["quantized"] == 1 and p.stats["head_int8"] == 1 and not p.notes
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulNBits") == 2 and ("Add" in ops) == (rows > 1)
    head = next(n for n in model.graph if n.op_type == "MatMulNBits" and n.attributes["bits"].value == 8)
    assert head.attributes["N"].value == V
    # the int4 layer is exact; the lm_head's int8 rounds a Q4_1 grid by at most half its 8-bit step
    err = error(_run(model, x), want)
    print(f"rows {rows}, softcap {softcap}: max_rel {err['max_rel']:.2e}")
    assert err["max_rel"] < 5e-3


def test_int8_quantizes_every_layer_symmetric():
    rng = np.random.default_rng(5)
    model, x = _lm_graph(rng, 5, False), rng.standard_normal((1, 5, K)).astype(np.float32)
    want = _run(model, x)
    p = QuantizeBlocks(8, accuracy_level=0)
    p(model)
    assert p.stats["quantized"] == 1 and p.stats["head_int8"] == 1
    assert [n.attributes["bits"].value for n in model.graph if n.op_type == "MatMulNBits"] == [8, 8]
    assert "MatMul" not in [n.op_type for n in model.graph] and error(_run(model, x), want)["max_rel"] < 5e-3
    with pytest.raises(ValueError, match="bits=3; expected 4"):
        QuantizeBlocks(3, accuracy_level=4)


def test_a_graph_without_the_blocks_minimum_is_refused():
    # planted fault: the codes alone (the per-block rest c not added) are what a pass forgetting the minimum computes
    rng = np.random.default_rng(3)
    model, x = _lm_graph(rng, 5, False), rng.standard_normal((1, 5, K)).astype(np.float32)
    want = _run(model, x)
    QuantizeBlocks(4, accuracy_level=0)(model)
    add = next(n for n in model.graph if n.op_type == "Add")
    add.outputs[0].replace_all_uses_with(add.inputs[0])
    assert error(_run(model, x), want)["max_rel"] > 0.1


def test_what_cannot_be_quantized_is_named():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((40, V)).astype(np.float32)  # K = 40: not whole blocks
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 40])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, V])],
                              [numpy_helper.from_array(w, "w")])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    p = QuantizeBlocks(4, accuracy_level=4)
    assert p(model).modified is False
    assert p.notes[0]["reason"] == f"K = 40 is not a multiple of {BLOCK}"
