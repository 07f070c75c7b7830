"""einsum_to_matmul: every two-operand Einsum it rewrites computes what the Einsum did; the rest is left, noted."""
import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes.einsum_to_matmul import EinsumToMatMul


def einsum_model(equation, shapes):
    inputs = [oh.make_tensor_value_info(f"x{i}", onnx.TensorProto.FLOAT, s) for i, s in enumerate(shapes)]
    node = oh.make_node("Einsum", [f"x{i}" for i in range(len(shapes))], ["y"], equation=equation)
    graph = oh.make_graph([node], "g", inputs, [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)])
    model.ir_version = 10
    model = onnx.shape_inference.infer_shapes(model)
    return ir.serde.deserialize_model(model)


def run(model, feeds):
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("equation, shapes", [
    ("bhtd,bhsd->bhts", [[2, 4, 5, 8], [2, 4, 7, 8]]),          # attention scores
    ("bhts,bhsd->bhtd", [[2, 4, 5, 7], [2, 4, 7, 8]]),          # weights @ V
    ("bgrtd,bgsd->bgrts", [[2, 2, 3, 5, 8], [2, 2, 7, 8]]),     # grouped-query scores: r broadcast over K
    ("bgrts,bgsd->bgrtd", [[2, 2, 3, 5, 7], [2, 2, 7, 8]]),
    ("td,sd->ts", [[5, 8], [7, 8]]),                            # one head, no batch
    ("...td,...sd->...ts", [[2, 3, 5, 8], [2, 1, 7, 8]]),       # ellipsis, broadcast
    ("bhqk,bkhd->bqhd", [[2, 4, 5, 7], [2, 7, 4, 8]]),          # output in another order
    ("abcd,cd->ab", [[2, 3, 4, 5], [4, 5]]),                    # two contracted indices
    ("ij,j->i", [[3, 4], [4]]),                                 # matrix-vector
    ("ij,jk", [[3, 4], [4, 5]]),                                # implicit output
])
def test_rewritten_einsum_computes_the_same(equation, shapes):
    model = einsum_model(equation, shapes)
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    want = run(model, feeds)
    p = EinsumToMatMul()
    p(model)
    assert p.stats["fused"] == 1 and not any(n.op_type == "Einsum" for n in model.graph), p.notes
    np.testing.assert_allclose(run(model, feeds), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, shapes, reason", [
    ("ij,jk,kl->il", [[2, 3], [3, 4], [4, 5]], "over 3 operands"),
    ("ij,kl->ijkl", [[2, 3], [4, 5]], "contracts no index"),
    ("ij,jk->i", [[2, 3], [3, 4]], "sums an index within one operand"),
    ("ii,ij->ij", [[3, 3], [3, 4]], "repeats an index"),
])
def test_other_einsums_are_left_with_the_reason(equation, shapes, reason):
    model = einsum_model(equation, shapes)
    p = EinsumToMatMul()
    p(model)
    assert p.stats["unfused"] == 1 and reason in p.notes[0]["reason"]
    assert [n.op_type for n in model.graph] == ["Einsum"]
