"""Every gate can fail: each is fed a deliberately broken output or graph and must refuse it.

Gates: the error rule itself (runtime/metrics.py), export step and sequence parity, the quantized steps, the quantized
accuracy on the prompt set (export/exporter.py), and `python -m passes --verify`. A test's name says which gate and
which planted fault; its assertion names the measure that trips (max_rel, non-finite, top-1, shape).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx_ir as ir
import pytest
import torch

import export.exporter as exporter
import passes.__main__ as passes_cli
from export.exporter import AccuracyError, ParityError
from export.quantize import budget, step_budget
from registry import GRID_RULE
from models import build_model, preset
from passes.verify import compare
from runtime import accuracy
from runtime.metrics import TOLERANCE, error, logit_error, why_not
from runtime.parity import reference_model

# Every budget in use: the float tolerances, and the quantization rule's bounds (each scheme's budget on a model lies
# between its floor and its cap), whole (the accuracy prompt set) and per step.
BUDGETS = {f"float-{d}": budget("ort", t) for d, t in TOLERANCE.items()} | \
          {"grid-floor": GRID_RULE.floor, "grid-cap": GRID_RULE.cap, "grid-cap-step": step_budget(GRID_RULE.cap)}


# -- broken outputs (numpy) ----------------------------------------------------------------------------------------

def _nan_at_one(x):
    y = x.copy()
    y.flat[y.size // 2] = np.nan
    return y


def _inf_at_one(x):
    y = x.copy()
    y.flat[0] = np.inf
    return y


BROKEN = {  # fault -> (the broken output, the measure it trips)
    "zeros": (np.zeros_like, "max_rel"),
    "nan": (_nan_at_one, "non-finite"),
    "inf": (_inf_at_one, "non-finite"),
    "shuffled": (lambda x: np.random.default_rng(0).permutation(x.reshape(-1)).reshape(x.shape), "max_rel"),
    "constant": (lambda x: np.full_like(x, x.mean()), "max_rel"),
    "noise": (lambda x: np.random.default_rng(1).standard_normal(x.shape).astype(x.dtype) * x.std(), "max_rel"),
}


@pytest.fixture(scope="module")
def eager_outputs():
    """Real references: the tiny LM's logits [1, 24, V] and the tiny block's hidden states [1, 24, E]."""
    config = preset("tiny")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits = reference_model(build_model(config, "lm", 0)).forward_full(
            torch.randint(0, config.vocab_size, (1, 24), generator=gen))
        hidden = reference_model(build_model(config, "block", 0)).forward_full(torch.randn(1, 24, config.hidden_size,
                                                                                         generator=gen))
    return {"logits": (logits.numpy(), logit_error), "hidden": (hidden.numpy(), error)}


@pytest.mark.parametrize("held", BUDGETS)
@pytest.mark.parametrize("fault", BROKEN)
@pytest.mark.parametrize("output", ["logits", "hidden"])
def test_metrics_rule_refuses_broken_output(eager_outputs, output, fault, held):
    ref, measure = eager_outputs[output]
    broken, trips = BROKEN[fault]
    why = why_not(measure(broken(ref), ref), BUDGETS[held])
    assert why is not None and why.startswith(trips), (output, fault, held, why)
    assert why_not(measure(ref.copy(), ref), BUDGETS[held]) is None  # and the reference itself passes


@pytest.mark.parametrize("fault", ["zeros", "shuffled", "constant", "noise"])
def test_metrics_distribution_measures_refuse_broken_logits(eager_outputs, fault):
    """KL and top-1 refuse a broken output on their own too, beside max_rel, at the loosest quantized budget."""
    ref, _ = eager_outputs["logits"]
    err, held = logit_error(BROKEN[fault][0](ref), ref), GRID_RULE.cap
    assert err["kl_mean"] > held.kl_mean and err["top1"] < held.top1, err


# -- broken graphs (onnx_ir, in place) -----------------------------------------------------------------------------

def _constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array))
    graph.register_initializer(value)
    return value


def _append(graph: ir.Graph, op: str, inputs: list[ir.Value], like: ir.Value) -> ir.Value:
    """A new node `op` after the graph's nodes; its output typed and shaped like `like` (the checks want them static)."""
    node = ir.Node("", op, inputs, num_outputs=1)
    graph.append(node)
    out = node.outputs[0]
    out.type, out.shape = like.type, like.shape
    return out


def _replace_output(graph: ir.Graph, i: int, op: str, operand: np.ndarray) -> None:
    """The i-th graph output becomes `op`(it, operand), under its old name."""
    old = graph.outputs[i]
    new = _append(graph, op, [old, _constant(graph, f"planted_{op}", operand)], old)
    name, old.name = old.name, f"{old.name}_before_fault"
    new.name, graph.outputs[i] = name, new


def zero_output(model: ir.Model) -> None:
    """The output (hidden states or logits) times 0, in the output's own dtype (an fp16 graph's too)."""
    _replace_output(model.graph, 0, "Mul", np.zeros((), model.graph.outputs[0].dtype.numpy()))


def nan_output(model: ir.Model) -> None:
    """One NaN in the output."""
    out = model.graph.outputs[0]
    operand = np.zeros([d for d in out.shape], np.float32)
    operand.flat[operand.size // 2] = np.nan
    _replace_output(model.graph, 0, "Add", operand)


def swap_kv(model: ir.Model) -> None:
    """present_key and present_value swapped (same shape, so nothing but the values can tell)."""
    g = model.graph
    key, value = g.outputs[1], g.outputs[2]
    names = key.name, value.name
    key.name = "planted_swap"
    value.name, key.name = names
    g.outputs[1], g.outputs[2] = value, key


def mask_off_by_one(model: ir.Model) -> None:
    """The causal mask (key position <= query position) compares against the query position + 1: each query sees
    the row after its own."""
    node = next(n for n in model.graph if n.op_type == "LessOrEqual")
    query = node.inputs[1]
    one = _constant(model.graph, "planted_one", np.ones((), query.dtype.numpy()))
    shifted = ir.Node("", "Add", [query, one], num_outputs=1)
    model.graph.insert_before(node, shifted)
    shifted.outputs[0].type, shifted.outputs[0].shape = query.type, query.shape
    node.replace_input_with(1, shifted.outputs[0])


def drop_rope(model: ir.Model) -> None:
    """Every RotaryEmbedding node removed: Q and K go on unrotated."""
    for node in [n for n in model.graph if n.op_type == "RotaryEmbedding"]:
        ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])
        model.graph.remove(node, safe=True)


GRAPH_FAULTS = {  # fault -> (how it is planted, the measure it trips)
    "zero_output": (zero_output, "max_rel 1 >"),
    "nan_output": (nan_output, "non-finite"),
    "swapped_kv": (swap_kv, "max_rel"),
    "mask_off_by_one": (mask_off_by_one, "max_rel"),
    "dropped_rope": (drop_rope, "max_rel"),
}


def _plant_in_export(monkeypatch, fault, target: str) -> None:
    """The exporter's pipelines return `target`'s graphs with `fault` planted (before they are saved and checked)."""
    real = exporter.run_pipelines

    def planted(exported, targets, fix_dims=None):
        done = real(exported, targets, fix_dims)
        if target in done:
            fault(done[target][0])
        return done
    monkeypatch.setattr(exporter, "run_pipelines", planted)


# -- export parity: every step of every target against eager PyTorch -----------------------------------------------

@pytest.mark.parametrize("fault, target", [("zero_output", "raw"), ("zero_output", "npu"), ("nan_output", "raw"),
                                           ("swapped_kv", "raw"), ("mask_off_by_one", "raw"), ("dropped_rope", "onnx")])
def test_export_step_parity_refuses(tmp_path, monkeypatch, fault, target):
    plant, trips = GRAPH_FAULTS[fault]
    _plant_in_export(monkeypatch, plant, target)
    with pytest.raises(ParityError, match=f"prefill.{target}.onnx: step parity against fp32 eager PyTorch: {trips}"):
        exporter.export_model(preset("tiny"), tmp_path / "out", targets=(target,), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_export_sequence_parity_refuses_a_stale_cache(tmp_path, monkeypatch):
    """Graphs that pass every step, run by a driver whose cache loses each step's rows: the sequence check refuses."""
    real = exporter._driver

    def stale(*args, **kwargs):
        driver = real(*args, **kwargs)
        step = driver._step

        def forgetful(session, x, p0):
            out = step(session, x, p0)
            driver._past, driver._present = driver._present, driver._past  # the next step reads the old cache
            return out
        driver._step = forgetful
        return driver
    monkeypatch.setattr(exporter, "_driver", stale)
    with pytest.raises(ParityError, match="raw: sequence parity .* against fp32 eager PyTorch: max_rel"):
        exporter.export_model(preset("tiny"), tmp_path / "out", targets=("raw",), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_fp16_parity_follows_what_fp16_costs_the_model_and_refuses_zeros(tmp_path, monkeypatch):
    """An fp16 step is held to 1e-2, or 3x the model's own eager fp16 error on the same inputs where that is more (a
    deep trained model drifts by itself), never past 0.05: planted, every case claims a drift of 0.5, and a graph of
    zeros must still be refused at the cap."""
    fp16 = preset("tiny").replace(dtype="fp16")
    assert exporter._budget(fp16, "npu").max_rel == 1e-2 and exporter._budget(fp16, "npu", 1e-3).max_rel == 1e-2
    assert exporter._budget(fp16, "npu", 1e-2).max_rel == pytest.approx(3e-2)
    assert exporter._budget(fp16, "npu", 0.5).max_rel == 0.05
    assert exporter._budget(preset("tiny"), "npu", 0.5).max_rel == 1e-4  # fp32 never follows a drift
    assert exporter._budget(fp16, "ort-int4", 0.5) == step_budget(GRID_RULE.cap)  # no grid measured: the cap
    grid = {"max_rel": 0.01, "kl_mean": 1e-3, "top1": 0.9}
    assert exporter._budget(fp16, "ort-int4", 0.5, grid=grid, step="decode").max_rel == pytest.approx(0.03)
    assert exporter._budget(fp16, "ort-int4", 0.5, grid=grid, step="prefill").max_rel == 0.05  # not quantized there
    real = exporter.step_case
    monkeypatch.setattr(exporter, "step_case", lambda *a, **k: _drifting(real(*a, **k), 0.5))
    _plant_in_export(monkeypatch, zero_output, "npu")
    with pytest.raises(ParityError, match="prefill.npu.onnx: step parity against fp32 eager PyTorch: max_rel 1 > 0.05 "
                                          r"\(output, p0=0\)"):
        exporter.export_model(fp16, tmp_path / "out", targets=("npu",), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def _drifting(case, first: float, others: float | None = None):
    """`case` claiming eager fp16 drifts by `first` on its first output (and by `others` on each cache, else as
    measured)."""
    drift = case.drift or (0.0,) * len(case.ref)
    return replace(case, drift=(first, *(d if others is None else others for d in drift[1:])))


def _scale_output(name: str, factor: float):
    def fault(model: ir.Model) -> None:
        """The graph output `name` times `factor`, in its dtype."""
        i = next(i for i, o in enumerate(model.graph.outputs) if o.name == name)
        _replace_output(model.graph, i, "Mul", np.array(factor, model.graph.outputs[i].dtype.numpy()))
    return fault


def test_an_fp16_output_is_held_to_its_own_drift(tmp_path, monkeypatch):
    """Each output follows what fp16 costs the model on that output, not the worst one's. Planted: the logits drift
    0.14 in eager fp16 (SmolLM2's worst prefill chunk), one layer's V cache is 5% off in the graph: within the
    logits' capped budget (0.05), refused at the V cache's own (1e-2; its eager fp16 error is measured)."""
    fp16 = preset("tiny").replace(dtype="fp16")
    real = exporter.step_case
    monkeypatch.setattr(exporter, "step_case", lambda *a, **k: _drifting(real(*a, **k), 0.14))
    _plant_in_export(monkeypatch, _scale_output("value.0", 1.05), "npu")
    with pytest.raises(ParityError, match=r"prefill.npu.onnx: step parity against fp32 eager PyTorch: max_rel 0.0\d+ > "
                                          r"0.01 \(present_value.0, p0=0\)"):
        exporter.export_model(fp16, tmp_path / "out", kind="lm", targets=("npu",), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def _swap_top2_in_graph(model: ir.Model) -> None:
    """Each logit row's best and runner-up swapped, inside the graph (TopK, then ScatterElements of the two values in
    reverse order)."""
    g = model.graph
    logits = g.outputs[0]
    k = _constant(g, "planted_k", np.array([2], np.int64))
    top = ir.node("TopK", [logits, k], attributes={"axis": -1}, num_outputs=2)
    g.append(top)
    values, indices = top.outputs
    order = _constant(g, "planted_order", np.array([1, 0], np.int64))
    rev = ir.node("Gather", [values, order], attributes={"axis": -1})
    g.append(rev)
    swap = ir.node("ScatterElements", [logits, indices, rev.outputs[0]], attributes={"axis": -1})
    g.append(swap)
    new = swap.outputs[0]
    new.type, new.shape = logits.type, logits.shape
    name, logits.name = logits.name, "logits_before_fault"
    new.name, g.outputs[0] = name, new


def test_an_fp16_graph_keeps_eager_argmax_where_eager_decides(tmp_path, monkeypatch):
    """A float graph's logits keep eager's argmax on each row whose eager top-2 margin exceeds 3x eager fp16's error
    there. Planted: an fp16 graph with every row's top two swapped (2.3% of max |logit| here), its logits claiming
    an eager fp16 drift of 2%, so max_rel alone (budget 0.05, 3x the drift capped) would pass it, as it did."""
    fp16 = preset("tiny").replace(dtype="fp16")
    real = exporter.step_case
    monkeypatch.setattr(exporter, "step_case", lambda *a, **k: _drifting(real(*a, **k), 0.02))
    _plant_in_export(monkeypatch, _swap_top2_in_graph, "ort")
    with pytest.raises(ParityError, match=r"step parity against fp32 eager PyTorch: argmax differs on \d+ row\(s\) whose "
                                          r"eager top-2 margin exceeds 3x eager fp16's error there \(logits, p0="):
        exporter.export_model(fp16, tmp_path / "out", kind="lm", targets=("ort",), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


# -- quantized targets: their steps (on prefilled caches) and their accuracy, each against the scheme's budget ------

def test_quantized_step_parity_refuses_zero_logits_at_the_int4_budget(tmp_path, monkeypatch):
    """int4's is the loosest budget; its decode step was once recorded, not checked."""
    _plant_in_export(monkeypatch, zero_output, "ort-int4")
    with pytest.raises(ParityError, match=r"^decode.ort-int4.onnx: step parity against fp32 eager PyTorch: max_rel 1 > "
                                          r"([\d.]+) \(logits, p0=\d+\); expected max_rel <= \1$"):
        exporter.export_model(preset("tiny"), tmp_path / "out", kind="lm", targets=("ort",), quant=("int4",),
                              log=lambda *_: None)
    assert not (tmp_path / "out").exists()


class Faulty:
    """A driver (reset, feed, decode -> logits [B, 1, V]) whose logits are `fault`(the real ones)."""

    def __init__(self, driver, fault):
        self.driver, self.fault = driver, fault

    def reset(self):
        self.driver.reset()

    def feed(self, ids):
        return self.fault(self.driver.feed(ids))

    def decode(self, ids):
        return self.fault(self.driver.decode(ids))


def test_quantized_accuracy_refuses_zero_logits(tmp_path, monkeypatch):
    """Graphs that pass their steps and sequences, measured through a driver that zeroes the logits (one prompt,
    to keep it quick): the accuracy gate refuses, naming the target, the measure and the budget."""
    real_measure, real_prompts = accuracy.measure, accuracy.prompt_set
    monkeypatch.setattr(accuracy, "prompt_set", lambda config: real_prompts(config)[:1])
    monkeypatch.setattr(accuracy, "measure", lambda driver, *args: real_measure(Faulty(driver, np.zeros_like), *args))
    with pytest.raises(AccuracyError, match=r"^ort-int4: accuracy on the prompt set against fp32 eager PyTorch: "
                                            r"max_rel 1 > ([\d.]+); expected max_rel <= \1, kl_mean <= [\d.e-]+, "
                                            r"top-1 >= \d+%$"):
        exporter.export_model(preset("tiny"), tmp_path / "out", kind="lm", targets=("ort",), quant=("int4",),
                              log=lambda *_: None)
    assert not (tmp_path / "out").exists()


class Eager:
    """Eager PyTorch as a driver: every call a full forward over the ids so far (exact, and cheap at tiny)."""

    def __init__(self, model):
        self.model, self.ids = model, None

    def reset(self):
        self.ids = None

    def feed(self, ids):
        ids = torch.from_numpy(np.asarray(ids))
        self.ids = ids if self.ids is None else torch.cat([self.ids, ids], dim=1)
        with torch.no_grad():
            return self.model.forward_full(self.ids)[:, -1:].numpy()

    decode = feed


def _swap_top2(logits):
    """Each row's best and runner-up logits swapped: a small change in max_rel and KL (random weights: near-ties),
    every top-1 token wrong."""
    out = logits.copy()
    order = np.argsort(out, axis=-1)
    best, second = order[..., -1:], order[..., -2:-1]
    a, b = np.take_along_axis(out, best, -1), np.take_along_axis(out, second, -1)
    np.put_along_axis(out, best, b, -1)
    np.put_along_axis(out, second, a, -1)
    return out


ACCURACY_FAULTS = {  # fault -> (the logits it gives, the measure that trips at every scheme's budget)
    "zeros": (np.zeros_like, "max_rel"),
    "nan": (lambda x: np.full_like(x, np.nan), "non-finite"),
    "shuffled": (BROKEN["shuffled"][0], "max_rel"),
}


@pytest.fixture(scope="module")
def prompt_set():
    config = preset("tiny")
    model = reference_model(build_model(config, "lm", 0))
    prompts = accuracy.prompt_set(config)[:2]
    return model, prompts, accuracy.references(model, prompts)


@pytest.mark.parametrize("fault", ACCURACY_FAULTS)
def test_quantized_accuracy_measure_refuses(prompt_set, fault):
    model, prompts, refs = prompt_set
    assert accuracy.measure(Eager(model), prompts, refs)["top1"] == 1  # the unbroken driver is exact
    broken, trips = ACCURACY_FAULTS[fault]
    measured = accuracy.measure(Faulty(Eager(model), broken), prompts, refs)
    for bound in (GRID_RULE.floor, GRID_RULE.cap):
        why = why_not(measured, bound)
        assert why is not None and why.startswith(trips), (bound, why, measured)


def test_quantized_accuracy_top1_refuses_swapped_top2_at_the_cap(prompt_set):
    """Every token wrong, yet within the loosest quantized max_rel and KL (random weights: the top two are
    near-ties): top-1 trips."""
    model, prompts, refs = prompt_set
    measured, held = accuracy.measure(Faulty(Eager(model), _swap_top2), prompts, refs), GRID_RULE.cap
    assert measured["max_rel"] <= held.max_rel and measured["kl_mean"] <= held.kl_mean
    assert why_not(measured, held) == f"top-1 agreement 0% < {held.top1:.0%}"


# -- python -m passes --verify: the rewritten graph against the graph before the passes -----------------------------

def _plant_in_cli(monkeypatch, fault) -> None:
    """The CLI's pipeline leaves `fault` planted in the graph it rewrote."""
    real = passes_cli.run_pipeline

    def planted(model, *args, **kwargs):
        report = real(model, *args, **kwargs)
        fault(model)
        return report
    monkeypatch.setattr(passes_cli, "run_pipeline", planted)


@pytest.mark.parametrize("fault", GRAPH_FAULTS)
def test_passes_verify_refuses(exported, tmp_path, monkeypatch, capsys, fault):
    plant, trips = GRAPH_FAULTS[fault]
    _plant_in_cli(monkeypatch, plant)
    out = tmp_path / "out.onnx"
    assert passes_cli.main([str(exported().folder / "decode.raw.onnx"), str(out), "--target", "onnx", "--verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: verify against the graph before the passes: ") and f" {trips}" in err, err
    assert err.count("\n") == 1
    assert not out.exists()


@pytest.fixture(scope="module")
def lm_decode(tmp_path_factory):
    """The tiny LM's decode step as torch.onnx writes it (no passes yet)."""
    from export.torch_export import to_onnx
    config = preset("tiny")
    path = tmp_path_factory.mktemp("lm") / "decode.onnx"
    ir.save(to_onnx(build_model(config, "lm", 0), config, 1, kind="lm"), path)
    return path


def test_passes_verify_holds_int4_to_its_budget(lm_decode, tmp_path, monkeypatch, capsys):
    """ort-int4 --verify passes within the scheme's step budget, and refuses zeroed logits against that budget."""
    assert passes_cli.main([str(lm_decode), str(tmp_path / "q.onnx"), "--target", "ort-int4", "--verify"]) == 0
    assert "verify: logits max abs" in capsys.readouterr().out
    _plant_in_cli(monkeypatch, zero_output)
    assert passes_cli.main([str(lm_decode), str(tmp_path / "z.onnx"), "--target", "ort-int4", "--verify"]) == 1
    assert capsys.readouterr().err == (f"error: verify against the graph before the passes: logits max_rel 1 > "
                                       f"{GRID_RULE.cap.max_rel:g}; {tmp_path / 'z.onnx'} not written\n")


def test_passes_verify_compare_refuses_a_shape_change(exported, tmp_path):
    """An output of another shape is reported, not a crash."""
    raw = exported().folder / "decode.raw.onnx"
    model = ir.load(raw)
    sliced = _append(model.graph, "Slice", [model.graph.outputs[0], *(_constant(model.graph, n, np.array(v)) for n, v in
                                             (("starts", [0]), ("ends", [1]), ("axes", [-1])))], model.graph.outputs[0])
    sliced.shape = ir.Shape([*model.graph.outputs[0].shape[:-1], 1])
    name, model.graph.outputs[0].name = model.graph.outputs[0].name, "unsliced"
    sliced.name, model.graph.outputs[0] = name, sliced
    result = compare(str(raw), ir.serde.serialize_model(model).SerializeToString())["output"]
    assert not result["ok"] and result["why"].startswith("shape (1, 1, 1); expected (1, 1, 64)"), result


def test_passes_verify_compare_lets_the_originals_own_nan_through(tmp_path):
    """NaN the graph before the passes has too (sqrt of a negative input) is not the rewrite's fault; a NaN it adds is."""
    import onnx
    import onnx.helper as oh
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])

    def graph(*nodes):
        model = oh.make_model(oh.make_graph(list(nodes), "g", [x], [y]), opset_imports=[oh.make_opsetid("", 20)])
        model.ir_version = 10  # what this onnxruntime reads
        return model.SerializeToString()
    before = graph(oh.make_node("Sqrt", ["x"], ["y"]))
    assert compare(before, graph(oh.make_node("Sqrt", ["x"], ["s"]), oh.make_node("Identity", ["s"], ["y"])))["y"]["ok"]
    added = compare(graph(oh.make_node("Abs", ["x"], ["a"]), oh.make_node("Sqrt", ["a"], ["y"])), before)["y"]
    assert not added["ok"] and added["why"].startswith("non-finite"), added
