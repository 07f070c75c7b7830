"""Quantized targets: int4/int8 MatMulNBits weights on ort, w8a16 QDQ on npu, their accuracy measured against eager."""
import json
import subprocess
import sys
import weakref
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export import export_model
from export.exporter import LintError
from export.quantize import (CALIBRATION_DECODE_STEPS, FIRST_TOKEN_PROMPTS, QuantError, SCHEMES, calibration_inputs,
                             parse, step_feeds)
from models import build_model, preset
from passes.lint import lint
from passes.mixed_precision import MAX_FLOAT_WEIGHTS, METADATA
from runtime import accuracy
from runtime.artifacts import open_generator
from registry import GRID_HEADROOM, GRID_RULE
from runtime.metrics import Budget, GridRule, why_not
from runtime.parity import reference_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "tiny-lm"
    manifest = export_model(preset("tiny"), out, kind="lm", quant=("int4", "int8", "w8a16"), log=lambda *_: None)
    return out, manifest


def _ops(path: Path) -> dict:
    model = onnx.load(str(path), load_external_data=False)
    ops = {}
    for n in model.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


def test_quantized_steps_are_checked_on_prefilled_caches(exported):
    """Every quantized step is within its scheme's budget, measured on caches eager filled from a real prefix."""
    _, m = exported
    for g in (g for g in m["graphs"] if g.get("quantized")):
        budget = m["lm"]["quantization"][g["target"]]["budget"]  # the rule over what the scheme's grid costs tiny
        assert g["parity"]["tolerance"] == budget["max_rel"] and g["parity"]["max_rel"] <= budget["max_rel"], g["parity"]
        assert g["parity"]["finite"] and 0 < g["parity"]["kl_mean"], g["parity"]  # the logits' KL is reported


def test_weight_only_graphs_keep_the_fusions(exported):
    out, m = exported
    layers = m["config"]["num_layers"]
    for bits in (4, 8):
        ops = _ops(out / f"decode.ort-int{bits}.onnx")
        found = [a.i for n in onnx.load(str(out / f"decode.ort-int{bits}.onnx"), load_external_data=False).graph.node
                 if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
        assert ops["GroupQueryAttention"] == layers
        if bits == 4:  # every linear layer at int4, each with its blocks' share (a small float MatMul); the lm_head int8
            assert found.count(8) == 1 and found.count(4) == ops["MatMul"] == 4 * layers
        else:  # every linear layer, lm_head included
            assert found == [8] * (4 * layers + 1) and "MatMul" not in ops
        assert "MatMulNBits" not in _ops(out / f"prefill.ort-int{bits}.onnx")  # prefill keeps fp32 (measured faster)
        entries = {(g["step"], g["target"]): g for g in m["graphs"]}
        assert entries["prefill", f"ort-int{bits}"]["quantized"] is False
        assert entries["decode", f"ort-int{bits}"]["quantized"] is True
    assert all(g["attention_fused"] == f"{layers}/{layers}" for g in m["graphs"] if g["target"] != "raw")


def test_a_transposed_stored_weight_is_quantized():
    """A tied lm_head reads the embedding through a Transpose the optimizer leaves unfolded at real sizes: the
    quantizer must still see it as a weight (it did not at minimind size before this was handled)."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper
    from passes.quantize_blocks import QuantizeBlocks
    table = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["h"]), helper.make_node("Transpose", ["table"], ["t"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "t"], ["logits"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 96])], [numpy_helper.from_array(table, "table")])
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])))
    p = QuantizeBlocks(4, accuracy_level=4)
    p(model)  # the one MatMul is the lm_head: int8
    assert p.stats["weights_untransposed"] == 1 and p.stats["head_int8"] == 1 and not p.notes
    assert [n.op_type for n in model.graph].count("Gather") == 1  # the embedding lookup still reads the table


def test_qdq_graphs_are_npu_clean(exported):
    out, m = exported
    for step in ("prefill", "decode"):
        path = out / f"{step}.npu-w8a16.onnx"
        assert lint(path, "npu") == []
        model = onnx.load(str(path), load_external_data=False)
        assert {o.domain: o.version for o in model.opset_import}[""] == 21
        inits = {i.name: i for i in model.graph.initializer}
        zero_types = {inits[n.input[2]].data_type for n in model.graph.node if n.op_type == "QuantizeLinear"}
        assert zero_types == {onnx.TensorProto.UINT16}
    calib = next(g for g in m["graphs"] if g["target"] == "npu-w8a16")["calibration"]
    assert calib["method"] == "MinMax" and calib["feeds"] > 0
    assert next(g for g in m["graphs"] if g["target"] == "npu-w8a16")["host_cache"]["mask_value"] == -100.0


def _declare(path: Path, out: Path, floats: dict | None = None, edit=None) -> Path:
    """A copy of the QDQ graph at `path` (its weights read from beside it) declaring `floats` float, or edited by
    `edit(model)`."""
    model = onnx.load(str(path))
    if floats is not None:
        del model.metadata_props[:]
        onnx.helper.set_model_props(model, {METADATA: json.dumps(floats)})
    if edit is not None:
        edit(model)
    onnx.save(model, str(out))
    return out


def test_w8a16_declarations_are_rechecked(exported, tmp_path):
    """Each activation a QDQ graph declares float is made by the graph for the reason it gives. Planted: a name the
    graph does not make, a Softmax output declared as a product, a range within +-WIDE_RANGE, no reason at all."""
    out, m = exported
    path = out / "decode.npu-w8a16.onnx"
    graph = onnx.load(str(path), load_external_data=False)
    declared = json.loads(next(p.value for p in graph.metadata_props if p.key == METADATA))
    assert {r["rule"] for r in declared.values()} >= {"op", "product"}, declared
    softmax = next(n.output[0] for n in graph.graph.node if n.op_type == "Softmax")
    product = next(k for k, r in declared.items() if r["rule"] == "product")
    assert declared[softmax] == {"rule": "op", "op": "Softmax"}
    planted = {"missing": declared | {"nowhere": {"rule": "product"}},
               "wrong rule": declared | {product: {"rule": "op", "op": "Softmax"}},
               "narrow range": declared | {product: {"rule": "range", "range": [0.0, 1.0]}},
               "no reason": declared | {product: {}}}
    for what, floats in planted.items():
        found = lint(_declare(path, tmp_path / "planted.onnx", floats), "npu")
        assert [(v.rule, v.node) for v in found] == [("float-justified", "nowhere" if what == "missing" else product)], \
            (what, found)
    # a Softmax output declared a product: what is rescaled from it (its Reshape) loses its reason too
    found = lint(_declare(path, tmp_path / "planted.onnx", declared | {softmax: {"rule": "product"}}), "npu")
    assert len(found) == 2 and found[0].node == softmax and "not a MatMul of two" in found[0].message, found


def test_an_all_float_graph_is_not_w8a16(exported, tmp_path):
    """The qdq profile (npu-w8a16's) wants Q/DQ and at most MAX_FLOAT_WEIGHTS of the matmul weights float. Planted:
    the float npu graph labelled w8a16 (through the export, and as a file); the QDQ graph with most weights float."""
    out, m = exported
    assert lint(out / "decode.npu-w8a16.onnx", "static-qdq") == []
    share = next(p for g in m["graphs"] if g["file"] == "decode.npu-w8a16.onnx" for p in g["passes"]
                 if p["pass"] == "quantize_qdq")["float_share"]
    assert share["matmuls"] > 0 and share["float_weights"] <= MAX_FLOAT_WEIGHTS, share
    found = lint(out / "decode.npu.onnx", "static-qdq")
    assert [v.rule for v in found] == ["qdq-present"] and "expected a QDQ graph" in found[0].message

    def float_weights(model):  # every weight's DequantizeLinear folded back to float
        init = {i.name: i for i in model.graph.initializer}
        for n in [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in init
                  and len(onnx.numpy_helper.to_array(init[n.input[0]]).shape) == 2]:
            q, scale = (onnx.numpy_helper.to_array(init[i]) for i in n.input[:2])
            model.graph.initializer.append(onnx.numpy_helper.from_array((q * scale).astype(np.float32), n.output[0]))
            model.graph.node.remove(n)
    found = lint(_declare(out / "decode.npu-w8a16.onnx", tmp_path / "floats.onnx", edit=float_weights), "static-qdq")
    assert any(v.rule == "qdq-present" and "100.0% of matmul weights float" in v.message for v in found), found


def test_the_export_refuses_a_float_graph_as_w8a16(tmp_path, monkeypatch):
    """Planted: a quantizer that returns the float graph untouched; the export's lint (profile static-qdq) refuses it."""
    monkeypatch.setattr("export.quantize.qdq", lambda model, feeds, opset: (model, sum(1 for _ in feeds), {}))
    with pytest.raises(LintError, match="qdq-present"):
        export_model(preset("tiny"), tmp_path / "out", kind="lm", quant=("w8a16",), targets=("npu",),
                     log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def _massive(tmp_path: Path, value: float) -> str:
    """The tiny lm's state dict with one token in eight carrying `value` in one channel of its embedding: a trained
    LM's massive activations, which the residual stream carries through every layer."""
    model = build_model(preset("tiny", tie_embeddings=False), "lm", seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[::8, 5] = value
    torch.save(model.state_dict(), tmp_path / "massive.pt")
    return str(tmp_path / "massive.pt")


def _written_by_the_mlp(tmp_path: Path) -> str:
    """The tiny lm with a trained LM's massive activations made where SmolLM2-135M makes them: one neuron of layer 0's
    MLP fires on a marker (one token in eight carries 30 in channel 5 of its embedding) at ~6000, and its down
    projection writes ~25000 into channel 5 of the residual stream; a matmul then reads and one writes a float
    activation."""
    model = build_model(preset("tiny", tie_embeddings=False), "lm", seed=0)
    mlp, neuron = model.model.layers[0].mlp, 3
    with torch.no_grad():
        model.model.embed_tokens.weight[::8, 5] = 30.0
        for proj, gain in ((mlp.gate_proj, 1.0), (mlp.up_proj, 100.0)):
            proj.weight[neuron] = 0.0
            proj.weight[neuron, 5] = gain
        mlp.down_proj.weight[:, neuron] = 0.0
        mlp.down_proj.weight[5, neuron] = 4.0
    torch.save(model.state_dict(), tmp_path / "by_mlp.pt")
    return str(tmp_path / "by_mlp.pt")


def _weights(graph) -> set[str]:
    """The graph's constants and what DequantizeLinear makes of them: a matmul's weight, float or quantized."""
    constants = {i.name for i in graph.initializer}
    return constants | {o for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants
                        for o in n.output}


def _float_by_op(graph) -> list[str]:
    """What w8a16 keeps float for its op, read from the graph: the attention probabilities (Softmax outputs, and their
    Reshapes), the norms' means of squares (FLOAT_OPS), and the products of two activations (Q K^T, P V: a MatMul
    with no weight, constant or dequantized from one)."""
    made = [o for n in graph.node if n.op_type in ("Softmax", "ReduceMean") for o in n.output]
    weights = _weights(graph)
    products = [n.output[0] for n in graph.node if n.op_type == "MatMul" and not weights & set(n.input)]
    return made + [o for n in graph.node if n.op_type == "Reshape" and n.input[0] in made for o in n.output] + products


def _w8a16(weights: str, out: Path) -> dict:
    m = export_model(preset("tiny", tie_embeddings=False), out, kind="lm", weights=weights, quant=("w8a16",),
                     targets=("npu",), log=lambda *_: None)
    steps = [g["parity"]["max_rel"] for g in m["graphs"] if g["target"] == "npu-w8a16"]
    a = m["lm"]["quantization"]["npu-w8a16"]["accuracy"]
    print(f"w8a16: steps max_rel {max(steps):.3f}, accuracy max_rel {a['max_rel']:.3f}, KL {a['kl_mean']:.2e}, "
          f"top-1 {a['top1']:.0%}")
    held = m["lm"]["quantization"]["npu-w8a16"]["budget"]["max_rel"]
    assert max(steps) <= held and a["max_rel"] <= held
    return m


def test_w8a16_holds_a_model_with_massive_activations(tmp_path):
    """Trained LMs carry a few residual rows with one huge channel (SmolLM2-135M: |x| ~ 25000 beside rows of ~3).
    Squared, such a row spans a 16-bit quantized tensor's range so that every other row's squares round to 0: the
    npu graph's RMSNorm computed mean(x^2) directly and SmolLM2's w8a16 prefill measured max_rel 1.99. Here one token
    in eight carries 500 in one channel, 6000x the median |x|, within WIDE_RANGE: every activation stays 16-bit; the
    export refuses a w8a16 graph past its budget, so it must complete. (A zero row, a padding token's embedding, is
    test_handoff.py's chat model.)"""
    m = _w8a16(_massive(tmp_path, 500.0), tmp_path / "out")
    for step in ("prefill", "decode"):  # float: the attention probabilities and means of squares alone (FLOAT_OPS)
        floats = next(p for g in m["graphs"] if g["file"] == f"{step}.npu-w8a16.onnx" for p in g["passes"]
                      if p["pass"] == "quantize_qdq")["float_activations"]
        graph = onnx.load(str(tmp_path / "out" / f"{step}.npu-w8a16.onnx"), load_external_data=False).graph
        assert sorted(floats) == sorted(_float_by_op(graph))


def test_w8a16_keeps_the_widest_activations_float(tmp_path, monkeypatch):
    """At SmolLM2's scale (25000 in one channel) one 16-bit grid over the residual stream steps by 0.76 and every
    ordinary value carries that error: those activations stay float (mixed precision), and the rest 16-bit. The matmuls
    beside them keep float weights: QNN's HTP refuses a per-channel weight's DequantizeLinear outside a quantized group
    (SmolLM2's down projections that write its massive activations). Planted: with those weights int8, lint and the
    HTP must refuse the graph; with every activation quantized, the export must refuse it."""
    from runtime import qnn
    weights = _written_by_the_mlp(tmp_path)
    m = _w8a16(weights, tmp_path / "out")
    for step in ("prefill", "decode"):
        qdq = next(p for g in m["graphs"] if g["target"] == "npu-w8a16" and g["step"] == step for p in g["passes"]
                   if p["pass"] == "quantize_qdq")
        path = tmp_path / "out" / f"{step}.npu-w8a16.onnx"
        graph = onnx.load(str(path), load_external_data=False).graph
        quantized = {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
        floats = set(qdq["float_activations"])
        assert floats and not quantized & floats, qdq["summary"]
        assert lint(path, "npu") == []  # declared, so not float islands
        undeclared = onnx.load(str(path), load_external_data=False)
        del undeclared.metadata_props[:]  # planted: undeclared, they are float islands and their weights float ones
        onnx.save(undeclared, str(tmp_path / "out" / "undeclared.onnx"))
        assert {v.rule for v in lint(tmp_path / "out" / "undeclared.onnx", "npu")} == {"qdq-complete", "qdq-weights"}
        # the residual stream, its norms' per-row scales and means of squares, the attention's products and
        # probabilities are float, no more: layer 0's up projection writes a float activation and its down projection
        # reads one, with float weights; the attention's matmuls (no weight) write float; every other matmul reads
        # 16-bit activations and int8 weights
        made_by = {o: n.op_type for n in graph.node for o in n.output}
        assert set(_float_by_op(graph)) <= floats
        matmuls = [n for n in graph.node if n.op_type == "MatMul"]
        beside = [n for n in matmuls if floats & {*n.input, *n.output}]
        weighted = [n for n in beside if n.input[1] in _weights(graph)]
        assert len(weighted) == 2 and all(made_by.get(n.input[1]) is None for n in weighted)
        attention = [n for n in beside if n not in weighted]
        assert len(attention) == 2 * 2 and all(n.output[0] in _float_by_op(graph) for n in attention)
        assert all(made_by.get(i) == "DequantizeLinear" for n in matmuls if n not in beside for i in n.input)
        assert len(floats) < len(quantized) / 4
        if qnn.available():
            qnn.session(path, 57)  # every node on the HTP, or Refused
    monkeypatch.setattr("export.quantize._float_weight_readers", lambda model, wide: [])
    monkeypatch.setattr("export.exporter.lint", lambda path, profile: [])  # the planted graph is written, then judged
    planted = tmp_path / "int8-beside-float"
    export_model(preset("tiny", tie_embeddings=False), planted, kind="lm", weights=weights, quant=("w8a16",),
                 targets=("npu",), log=lambda *_: None)
    found = lint(planted / "prefill.npu-w8a16.onnx", "npu")  # what the export's lint refuses (a LintError there)
    assert any(v.rule == "qdq-weights" and v.node == "node_linear_5" and "quantized beside the float activation"
               in v.message for v in found), found
    if qnn.available():  # what lint refused is what the HTP refuses
        with pytest.raises(qnn.Refused, match="DequantizeLinear: QNN EP does not support a standalone DQ op with "
                                              "per-channel quantization"):
            qnn.session(planted / "prefill.npu-w8a16.onnx", 57)
    monkeypatch.setattr("passes.mixed_precision.WIDE_RANGE", float("inf"))
    with pytest.raises(AssertionError, match="npu-w8a16"):
        export_model(preset("tiny", tie_embeddings=False), tmp_path / "all-16-bit", kind="lm", weights=weights,
                     quant=("w8a16",), targets=("npu",), log=lambda *_: None)
    assert not (tmp_path / "all-16-bit").exists()


def test_calibration_reaches_the_last_cache_rows_a_feed_at_a_time(exported):
    """The ranges must cover a decode step over a full cache (SmolLM2-135M's step over 2047 rows measured max_rel 0.535
    when no calibration prompt passed 392 tokens), and feeds are made as they are read: each carries the caches."""
    out, _ = exported
    config, driver = preset("tiny"), open_generator(out, "npu", ladder=False, provider="cpu")
    inputs = calibration_inputs(config, "lm")
    assert max(x.shape[1] for x in inputs) == config.capacity
    assert sum(x.shape[1] == 1 + CALIBRATION_DECODE_STEPS for x in inputs) == FIRST_TOKEN_PROMPTS
    positions, made, alive = [], [], []
    for feed in step_feeds(driver, inputs, "lm", "decode"):
        positions.append(int(feed["position_ids"][0, 0]))
        made.append(weakref.ref(feed["position_ids"]))
        alive.append(sum(r() is not None for r in made))  # feeds not yet freed, this one included
        del feed
    assert max(positions) == config.capacity - 1 and min(positions) == 0
    assert max(alive) <= 2 < len(made), alive


def test_calibration_decodes_the_models_own_greedy_tokens(exported):
    """The whole model's calibration reads a random prompt, then generates: each decode step feeds the token the
    float graph chose at the step before, not the input's next random token."""
    out, _ = exported
    steps = CALIBRATION_DECODE_STEPS
    x = calibration_inputs(preset("tiny"), "lm")[-2]  # a prompt of random length
    feeds = list(step_feeds(open_generator(out, "npu", ladder=False, provider="cpu"), [x], "lm", "decode"))
    driver, want = open_generator(out, "npu", ladder=False, provider="cpu"), []
    logits = driver.feed(x[:, :-steps])
    for _ in range(steps):
        want.append(int(np.argmax(logits[0, -1])))
        logits = driver.decode(np.array([[want[-1]]]))
    # the last `steps` decode feeds (a prompt's remainder may be read by the decode graph too)
    assert [int(f["input_ids"][0, 0]) for f in feeds[-steps:]] == want != x[0, -steps:].tolist()


def test_accuracy_is_measured_and_within_budget(exported):
    _, m = exported
    q = m["lm"]["quantization"]
    assert set(q) == {"ort-int4", "ort-int8", "npu-w8a16"}
    for target, entry in q.items():
        a, held = entry["accuracy"], entry["budget"]
        assert held == asdict(GRID_RULE.budget(entry["grid"])), target  # the rule over the grid, nothing else
        assert a["max_rel"] <= held["max_rel"] < 1 and a["kl_mean"] <= held["kl_mean"], target
        assert a["top1"] >= held["top1"], target
        assert 0 < a["kl_mean"] and 0 <= a["top1"] <= 1 and len(a["prompts"]) == accuracy.PROMPTS
    # more bits, closer to fp32: a scheme mix-up (int8 graphs written as int4) would break this
    assert q["ort-int8"]["accuracy"]["kl_mean"] < q["ort-int4"]["accuracy"]["kl_mean"]
    assert q["ort-int8"]["accuracy"]["max_rel"] < q["ort-int4"]["accuracy"]["max_rel"]


def test_the_grid_rounds_what_the_graph_quantizes(exported):
    """The budget's reference rounds the layers the int4 decode graph quantizes, no fewer (a model whose products the
    reference misses would get a budget from a grid it does not have); and it costs something."""
    out, m = exported
    q = m["lm"]["quantization"]
    graph = onnx.load(str(out / "decode.ort-int4.onnx"), load_external_data=False)
    quantized = sum(np.prod([a.i for a in n.attribute if a.name in "KN"]) for n in graph.graph.node if n.op_type == "MatMulNBits")
    assert q["ort-int4"]["grid"]["weights"] == q["ort-int8"]["grid"]["weights"] == quantized  # q, k, v packed in one
    assert q["ort-int4"]["grid"]["layers"] == 7 * m["config"]["num_layers"] + 1
    for target, entry in q.items():
        assert 0 < entry["grid"]["kl_mean"] and entry["grid"]["max_rel"] > 0, target
    assert q["ort-int4"]["grid"]["kl_mean"] > q["ort-int8"]["grid"]["kl_mean"]  # the coarser grid costs more


def test_a_graph_on_a_coarser_grid_than_its_scheme_is_refused(exported):
    """Planted: int4 graphs labelled int8. The int8 budget follows what int8's grid costs this model, so the int4
    graph's accuracy misses it; a budget set where the gated graph landed would have passed it."""
    _, m = exported
    q = m["lm"]["quantization"]
    int4, held = q["ort-int4"]["accuracy"], Budget(**q["ort-int8"]["budget"])
    assert why_not(int4, held) is not None and why_not(q["ort-int8"]["accuracy"], held) is None


def test_the_rule_follows_the_grid_within_its_floor_and_cap():
    rule = GridRule(3.0, floor=Budget(1e-2, kl_mean=1e-4, top1=0.95), cap=Budget(0.75, kl_mean=0.5, top1=0.25))
    assert rule.budget(None) == rule.cap
    got = rule.budget({"max_rel": 0.1, "kl_mean": 0.01, "top1": 0.9})
    assert (got.max_rel, got.kl_mean, got.top1) == pytest.approx((0.3, 0.03, 0.7))
    assert rule.budget({"max_rel": 0.0, "kl_mean": 0.0, "top1": 1.0}) == Budget(1e-2, kl_mean=1e-4, top1=0.95)
    assert rule.budget({"max_rel": 0.5, "kl_mean": 1.0, "top1": 0.1}) == Budget(0.75, kl_mean=0.5, top1=0.25)
    assert GRID_RULE.k == GRID_HEADROOM


def test_the_accuracy_measure_can_fail(exported):
    """fp32 graphs measure as exact; the same graphs with noise on their logits do not."""
    out, _ = exported
    config = preset("tiny")
    prompts = accuracy.prompt_set(config)
    refs = accuracy.references(reference_model(build_model(config, "lm", seed=0)), prompts)
    exact = accuracy.measure(open_generator(out, "ort", provider="cpu"), prompts, refs)
    assert exact["max_rel"] < 1e-4 and exact["kl_mean"] < 1e-8 and exact["top1"] == 1 and exact["greedy_match"] == 1

    class Noisy:
        def __init__(self, driver):
            self.driver, self.rng = driver, np.random.default_rng(0)

        def reset(self):
            self.driver.reset()

        def feed(self, ids):
            return self.driver.feed(ids) + self.rng.normal(0, 1, (1, 1, config.vocab_size))

        def decode(self, ids):
            return self.driver.decode(ids) + self.rng.normal(0, 1, (1, 1, config.vocab_size))
    noisy = accuracy.measure(Noisy(open_generator(out, "ort", provider="cpu")), prompts, refs)
    assert noisy["kl_mean"] > 1e-2 and noisy["max_rel"] > 0.1 and noisy["top1"] < 1


def test_generate_runs_a_quantized_target(exported):
    out, _ = exported
    res = subprocess.run([sys.executable, "-m", "runtime.generate", str(out), "--target", "ort-int4", "--prompt-ids",
                          "1,2,3", "--max-new-tokens", "4", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["generated_ids"]) == 4


def test_passes_cli_quantizes_a_raw_graph(exported, tmp_path):
    out, _ = exported
    res = subprocess.run([sys.executable, "-m", "passes", str(out / "decode.raw.onnx"), str(tmp_path / "q.onnx"),
                          "--target", "ort-int4"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "quantize_blocks" in res.stdout and "MatMulNBits" in _ops(tmp_path / "q.onnx")


def test_bad_schemes_are_named(tmp_path):
    assert parse("int4, w8a16") == ("int4", "w8a16") and parse("none") == ()
    with pytest.raises(QuantError, match="unknown scheme.*int3"):
        parse("int3")
    with pytest.raises(QuantError, match="npu target, which is not exported"):
        export_model(preset("tiny"), tmp_path / "x", kind="lm", targets=("ort",), quant=("w8a16",), log=lambda *_: None)
    assert not (tmp_path / "x").exists()
    res = subprocess.run([sys.executable, "-m", "export", "--preset", "tiny", "--quant", "int3", "--out",
                          str(tmp_path / "y")], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1 and res.stderr.strip().splitlines() == [
        "error: --quant: unknown scheme(s) ['int3']; expected a comma-separated list of " + ", ".join(SCHEMES) + " or none"]


def _htp_error(path: Path) -> float:
    """A prefill of the graph at `path` on QNN's HTP (fp16, emulated) against onnxruntime's CPU run of the same graph:
    the worst output's max |a - e| / max |e|. Tokens 0..15, so the massive rows (every eighth token) are read."""
    import onnxruntime as ort
    from runtime import qnn
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    for i in cpu.get_inputs():
        if "int" in i.type:
            feeds[i.name] = (np.arange(np.prod(i.shape)).reshape(i.shape) % 16).astype(np.int32)
        elif i.name.startswith("attention_mask"):  # the 16 new tokens see the cache's first 16 rows
            feeds[i.name] = np.broadcast_to(np.where(np.arange(i.shape[-1]) < 16, 0, -100), i.shape).astype(np.float32)
        else:
            feeds[i.name] = np.random.default_rng(0).standard_normal(i.shape).astype(np.float32) * 0.1
    want, got = cpu.run(None, feeds), qnn.session(path, 57).run(None, feeds)
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))


def test_massive_rows_hold_on_the_htp(tmp_path):
    """QNN's HTP divides in fp16 through a reciprocal, and 1/25000 is subnormal there, flushed to zero: the npu RMSNorm's
    x / max|x| gave massive rows all zeros (K/V of layer 0 off by 86%). Its x / sqrt(m) / sqrt(m) must hold within the
    fp16 tolerance. Planted: the one-step division, on such a row, must be refused."""
    from onnx import TensorProto, helper
    from runtime import qnn
    out = tmp_path / "out"
    export_model(preset("tiny", tie_embeddings=False), out, kind="lm", weights=_massive(tmp_path, 25000.0),
                 targets=("npu",), log=lambda *_: None)
    err = _htp_error(out / "prefill.npu.onnx")
    print(f"massive rows on the HTP: prefill max_rel {err:.2e} against onnxruntime CPU")
    assert err <= qnn.TOLERANCE
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
    peak = helper.make_node("ReduceMax", ["a"], ["m"], axes=[-1], keepdims=1)
    graph = helper.make_graph([helper.make_node("Abs", ["x"], ["a"]), peak, helper.make_node("Div", ["x", "m"], ["y"])],
                              "one_step", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "one_step.onnx")
    rows = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    rows[0, 5] = 25000.0
    got = qnn.session(tmp_path / "one_step.onnx", 57).run(None, {"x": rows})[0]
    want = rows / np.abs(rows).max(-1, keepdims=True)
    assert np.abs(got - want).max() / np.abs(want).max() > qnn.TOLERANCE


def test_the_htp_rounds_16_bit_probabilities_down(tmp_path):
    """Why w8a16 keeps attention probabilities float (export/quantize.py FLOAT_OPS): QNN's HTP rounds a 16-bit
    Softmax's outputs down, so a long row's small probabilities lose their mass; in fp16 they keep it. A row of 2176
    scores (a 2048-row cache and a 128-token chunk) with one sink, as a trained model's attention has."""
    from onnx import TensorProto, helper, numpy_helper
    from runtime import qnn
    n, rng = 2176, np.random.default_rng(0)
    x = (rng.standard_normal((1, 4, n)) * 2).astype(np.float32)
    x[..., 0], x[..., -100:] = 12.0, -100.0  # a sink; masked rows
    e = np.exp(x - x.max(-1, keepdims=True))
    want = (e / e.sum(-1, keepdims=True))[..., 1:].sum(-1)  # the mass past the sink: 0.07

    def mass(bits16: bool) -> np.ndarray:
        io = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [1, 4, n]) for v in ("x", "y")]
        nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
        inits = []
        if bits16:  # x and y each through a uint16 QuantizeLinear -> DequantizeLinear pair, as the w8a16 graphs had
            ranges = {"x": (-110.0, 30.0), "y": (0.0, 1.0)}
            for v, (lo, hi) in ranges.items():
                inits += [numpy_helper.from_array(np.array((hi - lo) / 65535, np.float32), f"{v}_s"),
                          numpy_helper.from_array(np.array(round(-lo / ((hi - lo) / 65535)), np.uint16), f"{v}_z")]
            nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
                     helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
                     helper.make_node("Softmax", ["xd"], ["p"], axis=-1),
                     helper.make_node("QuantizeLinear", ["p", "y_s", "y_z"], ["pq"]),
                     helper.make_node("DequantizeLinear", ["pq", "y_s", "y_z"], ["y"])]
        path = tmp_path / f"softmax{16 if bits16 else 32}.onnx"
        onnx.save(helper.make_model(helper.make_graph(nodes, "softmax", io[:1], io[1:], inits),
                                    opset_imports=[helper.make_opsetid("", 21)]), path)
        return qnn.session(path, 43, fp16=not bits16).run(None, {"x": x})[0][..., 1:].sum(-1)
    held, lost = mass(False), mass(True)
    print(f"mass past the sink {want.mean():.4f}: fp16 {held.mean():.4f}, 16-bit {lost.mean():.4f}")
    assert np.abs(held - want).max() < 1e-3 * want.max()
    assert (lost < 0.9 * want).all()


def test_a_folder_with_a_tokenizer_calibrates_on_text_first(tmp_path):
    """Random tokens never show a trained model its chat template (SmolLM2-135M's w8a16 on real prompts: KL 0.47
    calibrated on random tokens alone, 0.012 with text first). Planted: a tokenizer whose ids pass the model's vocab
    must be refused, not index past the embedding."""
    from chat_model import save_chat_model
    from export.quantize import CALIBRATION_CHATS, CALIBRATION_PROMPTS, CALIBRATION_TEXT
    tokenizer, _ = save_chat_model(tmp_path)
    config = preset("tiny", vocab_size=len(tokenizer))
    inputs = calibration_inputs(config, "lm", text=tmp_path)
    texts = len(CALIBRATION_CHATS) + len(CALIBRATION_TEXT)
    assert len(inputs) == texts + CALIBRATION_PROMPTS
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(x[0, 0] == start for x in inputs[:len(CALIBRATION_CHATS)])  # in the chat template
    first = tokenizer.decode(inputs[0][0, :-CALIBRATION_DECODE_STEPS])
    assert CALIBRATION_CHATS[0] in first and first.endswith("assistant\n")
    assert [x.shape[1] for x in calibration_inputs(config, "lm")] == [x.shape[1] for x in inputs[texts:]]
    with pytest.raises(QuantError, match="vocab_size"):
        calibration_inputs(preset("tiny", vocab_size=8), "lm", text=tmp_path)
