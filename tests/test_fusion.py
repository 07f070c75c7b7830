"""The fusion corpus: every graph ends with one fused attention op, no repeat, and eager parity."""
import collections
import copy

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from corpus import Variant, cases, export_case, variant_case
from passes.leftovers import unfused_attention
from passes.pipeline import run_pipeline
from runtime.parity import TOLERANCE, error, within

CASES = cases()
FUSED = {"onnx": "Attention", "ort": "GroupQueryAttention"}
_raw = {}


def raw_graph(case) -> ir.Model:
    if case.name not in _raw:
        _raw[case.name] = ir.serde.serialize_model(export_case(case))
    return ir.serde.deserialize_model(_raw[case.name])


def run(model: ir.Model, feeds: dict) -> list:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def eager_parity(case, model: ir.Model) -> dict:
    """The fused graph in onnxruntime against the eager module in fp32, at an empty and a full cache."""
    reference = copy.deepcopy(case.module).float()
    errs = []
    for p0 in ((0, case.config.capacity - case.seq_len) if case.cached else (0,)):
        args = case.inputs(p0, seed=p0 + 1)
        got = run(model, {n: a.numpy() for n, a in zip(case.input_names, args)})
        with torch.no_grad():
            want = reference(*[a.float() if a.is_floating_point() else a for a in args])
        want = want if isinstance(want, tuple) else (want,)
        live = p0 + case.seq_len  # present_* rows past the last written one are unspecified
        errs.append(error(got[0], want[0].numpy()))
        errs += [error(g[:, :, :live], w[:, :, :live].numpy()) for g, w in zip(got[1:], want[1:])]
    return {k: max(e[k] for e in errs) for k in ("max_abs", "max_rel")}


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corpus_fully_fuses_with_parity(case, target):
    model = raw_graph(case)
    report = run_pipeline(model, target)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Softmax"] == 0, report
    # The ort target keeps the standard op where GroupQueryAttention cannot express the graph (a mask that is
    # not causal by position); the case says which op it ends with.
    assert ops["Attention"] + ops["GroupQueryAttention"] == 1 and ops[case.expect[target]] == 1, ops
    rotary_in_gqa = any(n.op_type == "GroupQueryAttention" and n.attributes.get("do_rotary") for n in model.graph)
    assert ops["RotaryEmbedding"] == (0 if rotary_in_gqa or not case.rotary else 2), ops
    assert unfused_attention(model, report["passes"]) == []
    assert not [n for n in model.graph if n.op_type in ("Expand", "Tile")  # no K/V repeat in front of the fused op
                and any(u.op_type in FUSED.values() and i in (1, 2) for o in n.outputs for u, i in o.uses())]
    err = eager_parity(case, model)
    print(f"{target}: {case.name}: max abs {err['max_abs']:.2e}")
    assert within(err, case.config.dtype), err
    if case.config.dtype == "fp32":
        assert err["max_abs"] < TOLERANCE["fp32"]


@pytest.mark.parametrize("target", ["raw", "onnx", "ort"])
@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=["course", "last"])
def test_pipeline_is_idempotent(case, target):
    model = raw_graph(case)
    run_pipeline(model, target)
    once = ir.serde.serialize_model(model).SerializeToString()
    again = run_pipeline(model, target)
    assert ir.serde.serialize_model(model).SerializeToString() == once
    assert all(p["nodes_before"] == p["nodes_after"] for p in again["passes"])
    assert all(p["stats"].get("fused", 0) == 0 for p in again["passes"])


def test_tile_order_repeat_is_fused_correctly_and_reported():
    """h0,h1,h0,h1 is not the grouping Attention implements: the fusion keeps the repeat and says so."""
    case = variant_case(Variant("tile-order repeat", repeat="tile"))
    model = raw_graph(case)
    report = run_pipeline(model, "onnx")
    fuse = next(p for p in report["passes"] if p["pass"] == "fuse_attention")
    assert fuse["stats"]["fused"] == 1 and fuse["stats"]["repeat_kept"] == 1
    assert "cannot group" in fuse["not_matched"][0]["reason"]
    assert [x["reason"] for x in unfused_attention(model, report["passes"])][0].endswith("still a repeat of its KV heads")
    assert within(eager_parity(case, model), "fp32")


def test_head_order_matters():
    """The trap the tile case guards: grouping query heads the other way round gives wrong answers."""
    case = variant_case(Variant("course"))
    model = raw_graph(case)
    run_pipeline(model, "onnx")
    attention = next(n for n in model.graph if n.op_type == "Attention")
    k, v = attention.inputs[1], attention.inputs[2]
    b = len(list(model.graph))
    swapped = [ir.node("Gather", [x, ir.Value(name=f"perm{i}", const_value=ir.tensor(np.array([1, 0])))], {"axis": 1})
               for i, x in enumerate((k, v))]
    for i, node in enumerate(swapped):
        model.graph.register_initializer(node.inputs[1])
        model.graph.insert_before(attention, node)
        attention.replace_input_with(1 + i, node.outputs[0])
    assert len(list(model.graph)) == b + 2
    assert not within(eager_parity(case, model), "fp32")


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_unfusable_attention_says_why(target):
    """Scores through a ReLU are not attention the fused ops compute: left alone, with the reason."""
    case = variant_case(Variant("course"))
    model = raw_graph(case)
    div = next(n for n in model.graph if n.op_type == "Div")
    relu = ir.node("Relu", [div.outputs[0]])
    model.graph.insert_after(div, relu)
    for user, index in list(div.outputs[0].uses()):
        if user is not relu:
            user.replace_input_with(index, relu.outputs[0])
    relu.outputs[0].shape, relu.outputs[0].type = div.outputs[0].shape, div.outputs[0].type
    report = run_pipeline(model, target)
    left = unfused_attention(model, report["passes"])
    assert len(left) == 1 and left[0]["op"] == "Softmax"
    assert "scores pass through Relu" in left[0]["reason"]
