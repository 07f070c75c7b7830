"""make handoff: the bundle lints clean, verifies from the bundle alone, says which runtime refuses which ops, and its
verifier refuses every fault planted into a graph from outside."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from export import quantize
from export.handoff import build
from models import preset
from runtime import qnn
from runtime.metrics import FP16_CAP, FP16_HEADROOM, why_not
from runtime import verify
from runtime.verify import HostCache, budget, main as verify_main, verify_graph

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("handoff") / "handoff"
    build(preset("tiny"), out, socs=(57,), log=lambda *_: None)  # make handoff compiles for three SoCs
    return out


def test_bundle_contents(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    files = {g["file"] for g in m["graphs"]}
    for kind in ("attention", "block"):
        assert {f"{kind}-fp32/{s}.{t}.onnx" for s in ("prefill", "decode") for t in ("npu", "onnx")} <= files
        assert {f"{kind}-fp16/{s}.npu.onnx" for s in ("prefill", "decode")} <= files
    assert {f"lm-{d}/{s}.npu.onnx" for s in ("prefill", "decode") for d in ("fp32", "fp16")} <= files
    assert (bundle / "lm-fp32/weights.data").is_file() and m["contract"]["lm_npu"]["outputs"].startswith("logits")
    assert all((bundle / g["golden"]).exists() for g in m["graphs"])
    lints = json.loads((bundle / "lint.json").read_text())
    assert all(lints[g["file"]]["violations"] == [] for g in m["graphs"])
    assert {n["rule"] for n in lints["lm-fp32/decode.npu.onnx"]["notes"]} == {"qnn-fp16-precision"}
    assert m["contract"]["npu"]["mask_value"] == -30000.0 and m["contract"]["npu"]["opset"] == 17
    accepted = {"refuses": []}
    assert m["format"] == 3 and m["runtimes"]["onnxruntime"] == {"onnx": accepted, "npu": accepted, "npu-w8a16": accepted}
    # OpenVINO 2026.4 has no TensorScatter, nor has QNN's HTP (nor Attention with a boolean mask); both run the QDQ
    # graphs within their budget. What they refuse is recorded by name, with the error that named it.
    assert m["runtimes"]["openvino-cpu"] == {"onnx": {"refuses": ["TensorScatter"], "error": "RuntimeError: No conversion "
                                                      "rule found for operations: TensorScatter-24"},
                                             "npu": accepted, "npu-w8a16": accepted}
    htp = m["runtimes"]["qnn-htp-57"]
    assert htp["onnx"]["refuses"] == ["Attention", "TensorScatter"] and htp["onnx"]["error"].startswith(
        "Refused: the HTP of SoC 57 refuses Attention, TensorScatter: ")
    assert htp["npu"] == accepted and htp["npu-w8a16"] == accepted
    qdq = [g for g in m["graphs"] if g["target"] == "npu-w8a16"]
    assert {g["file"] for g in qdq} == {f"lm-fp32/{s}.npu-w8a16.onnx" for s in ("prefill", "decode")}
    # held as the export held its steps: the rule over what w8a16's grid costs this model (export/grid_cost.py)
    held = json.loads((bundle / "lm-fp32/manifest.json").read_text())["lm"]["quantization"]["npu-w8a16"]["budget"]
    assert all(g["quantized"]["scheme"] == "w8a16" and g["budget"] == {"max_rel": held["max_rel"]} for g in qdq)
    assert held["max_rel"] < quantize.tolerance("npu-w8a16", 1e-4)  # tighter than the rule's cap
    assert {g["budget"]["max_rel"] for g in m["graphs"] if g["target"] != "npu-w8a16"} == {1e-4, 1e-2}
    # their attention probabilities stay float (export/quantize.py FLOAT_OPS): compiled with fp16 precision on
    assert all(g["quantized"]["float_activations"] and g["qnn"]["57"]["fp16_precision"] is True
               and not g["qnn"]["57"]["placement"]["unsupported"] for g in qdq)
    assert m["qnn"]["socs"] == [57] and m["qnn"]["version"].startswith("QNN 2.51")
    for g in (g for g in m["graphs"] if g["target"] == "npu"):  # compiled, every node on the HTP
        compiled = g["qnn"]["57"]
        assert (bundle / compiled["wrapper"]).is_file() and compiled["soc_model"] == 57
        assert compiled["placement"]["htp_nodes"] > 10 and compiled["placement"]["unsupported"] == []
    assert set(m["qnn"]["binaries"]) == {f"qnn57/{k}.float.bin" for k in ("attention", "block", "lm")} | {
        "qnn57/lm.w8a16.bin"}
    assert re.search(r"\| 57 \| SM8650 \(Snapdragon 8 Gen 3, HTP v75\) \| `qnn57/` \| `attention.float.bin` [\d.]+ MB "
                     r"\(4 graphs\), ", (bundle / "README.md").read_text())
    assert "openvino-cpu: `onnx` no (refuses TensorScatter), `npu` yes" in (bundle / "README.md").read_text()
    lm = np.load(bundle / "lm-fp32/decode.npu.golden.npz")  # token ids in, caches left out
    assert lm["in.0.input_ids"].dtype == np.int32 and lm["out.0.logits"].shape == (1, 1, 128)
    past = [k for k in lm.files if "past_" in k]  # but the rows before a step no earlier step wrote
    assert sorted({k.split(".")[1] for k in past}) == ["0", "4"] and len(past) == 8
    assert lm["in.0.past_key.0"].shape == (1, 2, 16, 16) and lm["in.4.past_key.0"].shape == (1, 2, 63, 16)
    assert lm["out.4.key.1"].shape == (1, 2, 1, 16)


@pytest.mark.parametrize("path, positions", [
    ("attention-fp32/prefill.npu", [0, 16, 48]),  # a chunk at 0, one over its rows, one ending at the window's end
    ("attention-fp32/decode.onnx", [16, 17, 18, 19, 63]),  # right after the first chunk, and at the window's last row
])
def test_goldens_reach_the_window_s_depth(bundle, path, positions):
    golden = np.load(bundle / f"{path}.golden.npz")
    assert [int(golden[f"in.{i}.position_ids"][0, 0]) for i in range(int(golden["steps"]))] == positions
    assert golden["in.0.position_ids"].dtype == (np.int32 if "npu" in path else np.int64)
    deepest = golden[f"in.{len(positions) - 1}.past_key"]  # eager's rows of the sequence before the step, zeros after
    assert deepest[:, :, :positions[-1]].any(axis=-1).all() and not deepest[:, :, positions[-1]:].any()


def test_verify_needs_only_the_bundle(bundle):
    """No torch and none of the model code: the receiving engineer has neither."""
    code = ("import sys; sys.modules.update(torch=None, models=None, export=None, passes=None); "
            "from runtime.verify import main; sys.exit(main([sys.argv[1]]))")
    res = subprocess.run([sys.executable, "-c", code, str(bundle)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert sum(line.startswith("pass  onnxruntime") for line in lines) == 18
    assert sum(line.startswith("pass  openvino-cpu") for line in lines) == 14
    htp = [line for line in lines if line.startswith("pass  qnn-htp-57")]
    shipped = rf"shipped qnn57/\S+\.onnx \({re.escape(verify.PROVEN)}\)"
    assert len(htp) == 14 and sum(bool(re.search(shipped + ", fp16 on the HTP", line)) for line in htp) == 12
    budget = json.loads((bundle / "lm-fp32/manifest.json").read_text())["lm"]["quantization"]["npu-w8a16"]["budget"][
        "max_rel"]
    assert sum(bool(re.search(rf"{shipped}, quantized \(\d+ activations fp16\) on the HTP \(budget max_rel "
                              rf"{budget:g}\)", line)) for line in htp) == 2
    assert "top-1 100%" in [line for line in lines if "lm-fp32/decode.npu.onnx" in line][0]
    refused = [line for line in lines if line.startswith("not accepted (as the manifest says)")]
    assert len(refused) == 8 and all(".onnx.onnx: " in line and "TensorScatter" in line for line in refused)


def _rename(graph: onnx.GraphProto, names: dict) -> None:
    """Rename tensors everywhere in the graph, its inputs and outputs too."""
    for node in graph.node:
        node.input[:] = [names.get(x, x) for x in node.input]
        node.output[:] = [names.get(x, x) for x in node.output]
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = names.get(value.name, value.name)


def _scale(graph: onnx.GraphProto, op: str, value: float) -> None:
    """The main output (output, logits) through `op` with a constant: x * 0, x + NaN, x * 1.5."""
    main = graph.output[0].name
    _rename(graph, {main: f"{main}.unfaulted"})
    graph.output[0].name = main
    dtype = helper.tensor_dtype_to_np_dtype(graph.output[0].type.tensor_type.elem_type)
    graph.initializer.append(numpy_helper.from_array(np.array(value, dtype), "fault"))
    graph.node.append(helper.make_node(op, [f"{main}.unfaulted", "fault"], [main]))


def _swap(graph: onnx.GraphProto, key: str) -> None:
    """Swap a K tensor with its V (key/value, present_key/present_value, past_key.0/past_value.0, ...): swapping the
    names everywhere leaves the graph as it was inside, while from outside K goes where V should and back."""
    _rename(graph, {key: key.replace("key", "value"), key.replace("key", "value"): key})


FAULTS = {
    "zeros": lambda g: _scale(g, "Mul", 0.0),
    "NaN": lambda g: _scale(g, "Add", np.nan),
    "50% error": lambda g: _scale(g, "Mul", 1.5),
    "K/V outputs swapped": lambda g: _swap(g, g.output[1].name),
    "K/V inputs swapped": lambda g: _swap(g, next(i.name for i in g.input if i.name.startswith("past_key"))),
}


def plant(bundle: Path, graph: dict, fault: str) -> dict:
    """`fault` planted into a copy of the graph's file beside it (so it reads the same weights.data); the manifest
    entry of that copy, with no compiled QNN model (the HTP compiles the planted graph)."""
    model = onnx.load(bundle / graph["file"], load_external_data=False)
    FAULTS[fault](model.graph)
    planted = graph["file"].replace(".onnx", f".{re.sub(r'[^a-zA-Z0-9]+', '-', fault)}.onnx")  # 50% error: .50-error
    onnx.save(model, bundle / planted)
    return {k: v for k, v in graph.items() if k != "qnn"} | {"file": planted}


@pytest.fixture(scope="module")
def planted(bundle, tmp_path_factory):
    """{(graph file, fault): the planted graph's manifest entry}, in a copy of the bundle."""
    copy = tmp_path_factory.mktemp("planted") / "handoff"
    shutil.copytree(bundle, copy)
    graphs = json.loads((copy / "manifest.json").read_text())["graphs"]
    return copy, {(g["file"], fault): plant(copy, g, fault) for g in graphs for fault in FAULTS}


def test_every_planted_fault_is_refused(planted):
    """Every fault in every graph FAILs on onnxruntime and OpenVINO by the measure it breaks; OpenVINO does not load
    the onnx graphs at all (TensorScatter, as the manifest records). The QDQ graphs' budget (0.4 today) is under
    a 50% error too."""
    copy, entries = planted
    refuses = json.loads((copy / "manifest.json").read_text())["runtimes"]
    for (file, fault), graph in entries.items():
        for runtime in ("onnxruntime", "openvino-cpu"):
            r = verify_graph(copy, graph, runtime)
            where = f"{fault} in {file} on {runtime}: {r}"
            if "load_error" in r:
                assert refuses[runtime][graph["target"]]["refuses"] == ["TensorScatter"], where
                continue
            assert graph["budget"]["max_rel"] < 0.5 and not r["ok"], where
            output = r["why"].rsplit(" (", 1)[-1].rstrip(")")
            missed, held = r["per_output"][output], budget(graph, runtime, output)
            assert r["why"] == ("non-finite values (NaN or inf) where the reference is finite" if fault == "NaN"
                                else f"max_rel {missed['max_rel']:.3g} > {held.max_rel:g}") + f" ({output})", where
            assert r["max_rel"] >= {"zeros": 1.0, "50% error": 0.49}.get(fault, 0.4), where


def test_swapped_past_k_and_v_in_a_prefill_graph_is_caught_by_the_non_empty_cache(planted):
    """Over an empty cache (the prefill golden's first step) a prefill graph reading past K for V passes; the chunk
    at T, over the first chunk's rows, is what refuses it."""
    copy, entries = planted
    for (file, fault), graph in entries.items():
        if fault != "K/V inputs swapped" or "prefill" not in file:
            continue
        data = np.load(copy / graph["golden"])
        first = {k: data[k] for k in data.files if k.startswith(("in.0.", "out.0.", "live.0"))}
        np.savez(copy / f"{graph['file']}.first.npz", steps=np.array(1), **first)
        assert verify_graph(copy, graph | {"golden": f"{graph['file']}.first.npz"}, "onnxruntime")["ok"], file
        assert not verify_graph(copy, graph, "onnxruntime")["ok"], file


def test_verify_fails_a_bundle_with_a_planted_fault(bundle, tmp_path, capsys):
    """The CLI: exit 1 and FAIL on every runtime for a graph that runs and misses, even where the manifest records
    that runtime refusing the target (as an older bundle's False would have excused it); a wrong golden too."""
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    i = next(i for i, g in enumerate(manifest["graphs"]) if g["file"] == "attention-fp32/decode.npu.onnx")
    manifest["graphs"][i] = plant(copy, manifest["graphs"][i], "50% error")  # no compiled model: the HTP compiles it
    keep = {"attention-fp32/decode.npu.50-error.onnx", "block-fp32/decode.npu.onnx"}  # every other graph passes
    manifest["graphs"] = [g for g in manifest["graphs"] if g["file"] in keep]
    manifest["runtimes"]["openvino-cpu"]["npu"] = {"refuses": ["MatMul"], "error": "MatMul refused"}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    golden = copy / "block-fp32/decode.npu.golden.npz"
    data = dict(np.load(golden))
    data["out.3.output"] = data["out.3.output"] + 0.01
    np.savez(golden, **data)
    assert verify_main([str(copy)]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    runtimes = ["onnxruntime", "openvino-cpu"] + (["qnn-htp-57"] if qnn.available() else [])
    planted_fails = {line.split()[1]: float(line.split("max_rel ")[1].split()[0]) for line in fails
                     if "attention-fp32/decode.npu.50-error.onnx: max_rel " in line}
    assert list(planted_fails) == runtimes and all(0.49 <= e <= 0.51 for e in planted_fails.values()), planted_fails
    # the HTP runs fp32 graphs in fp16: its budget is fp16's
    assert any(line.startswith("FAIL  qnn-htp-57   attention-fp32/decode.npu.50-error.onnx: max_rel ") and
               "> 0.01 (output); " in line for line in fails) or not qnn.available()
    assert any(line.startswith("FAIL  onnxruntime  block-fp32/decode.npu.onnx: max_rel") for line in fails)


def test_the_htp_budget_follows_what_fp16_costs_the_model(bundle):
    """The HTP computes in fp16, where a deep trained model drifts from fp32 by itself (SmolLM2-135M: 1.0e-2 in eager
    PyTorch over 2048 rows), so each output there is held to FP16_HEADROOM times the model's fp16 error on that output
    over the window (fp16_drift) where that passes the fp16 tolerance, up to FP16_CAP; an fp16 graph's outputs on
    every runtime to that times their own goldens' (eager_fp16_max_rel). The tiny random models drift far less (under
    1/2 of it): a graph 2% off must fail there (planted: a logits drift of 1e-2 would pass it, and loosens no cache;
    one of 0.5 must not pass a graph of zeros)."""
    m = json.loads((bundle / "manifest.json").read_text())
    own = {g["file"]: g.get("eager_fp16_max_rel") for g in m["graphs"]}
    print("eager fp16 on the goldens:", own, "over the window:", {g["kind"]: g.get("fp16_drift") for g in m["graphs"]})
    assert all((d is not None and all(0 < e < qnn.TOLERANCE / 2 for e in d.values())) == ("-fp16/" in f)
               for f, d in own.items()), own
    assert all(0 < e < qnn.TOLERANCE / 2 for g in m["graphs"] for e in g["fp16_drift"].values()) or not qnn.available()
    half = next(g for g in m["graphs"] if g["file"] == "lm-fp16/decode.npu.onnx")
    assert set(half["output_budgets"]) == set(half["eager_fp16_max_rel"]) >= {"logits", "key.0", "value.1"}
    assert all(budget(half, "onnxruntime", k).max_rel == qnn.TOLERANCE for k in half["output_budgets"])
    graph = next(g for g in m["graphs"] if g["file"] == "lm-fp32/decode.npu.onnx")
    if qnn.available():
        assert budget(graph, "qnn-htp-57", "logits").max_rel == max(qnn.TOLERANCE,
                                                                    FP16_HEADROOM * graph["fp16_drift"]["logits"])
    assert budget(graph, "onnxruntime", "logits").max_rel == 1e-4
    assert why_not({"max_abs": 1.0, "max_rel": 0.02, "finite": True}, budget(graph, "qnn-htp-57", "logits"))
    deep = graph | {"fp16_drift": {"logits": 1e-2, "present_key.0": 1e-4}}  # by the contract's names
    assert budget(deep, "qnn-htp-57", "logits").max_rel == 3e-2 and budget(deep, "onnxruntime", "logits").max_rel == 1e-4
    assert why_not({"max_abs": 1.0, "max_rel": 0.02, "finite": True}, budget(deep, "qnn-htp-57", "logits")) is None
    assert budget(deep, "qnn-htp-57", "key.0").max_rel == qnn.TOLERANCE  # the npu graph's new rows: present_key.0's
    unstable = graph | {"fp16_drift": {"logits": 0.5}}  # planted: a model fp16 cannot hold must not pass zeros
    assert budget(unstable, "qnn-htp-57", "logits").max_rel == FP16_CAP
    assert why_not({"max_abs": 1.0, "max_rel": 1.0, "finite": True}, budget(unstable, "qnn-htp-57", "logits"))


def test_verify_refuses_a_folder_that_is_no_bundle(tmp_path, capsys):
    assert verify_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}: no readable manifest.json") and err.count("\n") == 1
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "graphs": []}))  # a compiled graph per file
    assert verify_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: manifest format 2; expected 3 (rebuild it with make handoff: " \
                                      "earlier bundles embed a copy of the weights in every compiled graph)\n"


def test_fully_masked_rows_stay_finite_in_fp16(bundle):
    """The mask is finite by design: even a row with nothing visible gives numbers, not NaN."""
    import onnxruntime as ort
    golden = np.load(bundle / "attention-fp16/decode.npu.golden.npz")
    graph = next(g for g in json.loads((bundle / "manifest.json").read_text())["graphs"]
                 if g["file"] == "attention-fp16/decode.npu.onnx")
    feeds = HostCache(graph["host_cache"], np.float16).feeds(
        {k.split(".", 2)[2]: golden[k] for k in golden.files if k.startswith("in.0.")})
    feeds["attention_mask"] = np.full_like(feeds["attention_mask"], -30000.0)
    out = ort.InferenceSession(str(bundle / "attention-fp16/decode.npu.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert all(np.isfinite(o.astype(np.float32)).all() for o in out)


def test_a_bundle_carries_the_window_ladder(tmp_path, capsys, trained):
    """Every graph over each window, with its own goldens (cache and mask W rows wide), verified from the bundle: the
    attention's here, the whole model's in the trained bundle (built over the ladder 32, 64)."""
    out = tmp_path / "handoff"
    build(preset("tiny"), out, kinds=("attention",), socs=(), windows=(32, 64), log=lambda *_: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["windows"] == [32, 64]
    small = {g["file"]: g for g in m["graphs"] if g["window"] == 32}
    assert set(small) == {f"attention-{d}/{s}.{t}.w32.onnx" for d, ts in (("fp32", ("npu", "onnx")), ("fp16", ("npu",)))
                          for t in ts for s in ("prefill", "decode")}
    golden = np.load(out / "attention-fp32/decode.npu.w32.golden.npz")
    assert small["attention-fp32/decode.npu.w32.onnx"]["host_cache"]["shape"][2] == 32
    assert golden["in.0.attention_mask"].shape[-1] == 33  # W rows + its own
    # the host keeps the cache: only the rows before a step no earlier step wrote (16 after the first chunk, 31 before
    # the last row), none for the steps between
    assert [golden[f"in.{i}.past_key"].shape[2] if f"in.{i}.past_key" in golden.files else 0 for i in range(5)] == \
        [16, 0, 0, 0, 31]
    onnx_golden = np.load(out / "attention-fp32/decode.onnx.w32.golden.npz")  # present: the rows written so far
    assert [onnx_golden[f"out.{i}.present_key"].shape[2] for i in range(5)] == [17, 18, 19, 20, 32]
    assert int(golden["in.4.position_ids"][0, 0]) == 31  # the window's last row: its depth, not C's
    prefill = np.load(out / "attention-fp32/prefill.npu.w32.golden.npz")
    assert [int(prefill[f"in.{i}.position_ids"][0, 0]) for i in range(int(prefill["steps"]))] == [0, 16]
    assert verify_main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("pass  onnxruntime") and ".w32." in line for line in lines) == len(small)
    lm = json.loads((trained / "handoff" / "manifest.json").read_text())
    assert lm["windows"] == [32, 64]
    lm_small = [g for g in lm["graphs"] if g["window"] == 32]
    assert {g["file"] for g in lm_small} == {f"lm-{d}/{s}.npu.w32.onnx" for d in ("fp32", "fp16")
                                            for s in ("prefill", "decode")}  # QDQ: C only
    assert all(g["host_cache"]["shape"][2] == 32 for g in lm_small)
    for g in lm_small:
        golden = np.load(trained / "handoff" / g["file"].replace(".onnx", ".golden.npz"))
        assert golden["in.0.attention_mask"].shape[-1] == 32 + golden["in.0.input_ids"].shape[1]  # W rows + its own
        assert verify_graph(trained / "handoff", g, "onnxruntime")["ok"], g["file"]


def test_a_window_too_small_for_the_goldens_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"windows \[16\]: a window's goldens hold two prefill chunks and 4 decode "
                                         r"steps after the first; expected W >= 32$"):
        build(preset("tiny"), tmp_path / "h", socs=(), windows=(16, 64), log=lambda *_: None)
    assert not (tmp_path / "h").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A bundle of a Hugging Face folder with a chat template (tests/chat_model.py), over the ladder 32, 64, compiled
    for one SoC."""
    from chat_model import save_chat_model
    root = tmp_path_factory.mktemp("trained")
    save_chat_model(root / "hf", initializer_range=0.1)
    build(preset("tiny", source="transformers"), root / "handoff", socs=(57,), windows=(32, 64),
          weights=str(root / "hf"), log=lambda *_: None)
    return root


def test_a_trained_model_bundle_says_what_every_runtime_answers(trained):
    import torch
    import transformers
    from chat_model import MESSAGE
    bundle = trained / "handoff"
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["kinds"] == ["lm"] and m["weights"] == str(trained / "hf")
    assert {g["file"].split("/")[0] for g in m["graphs"]} == {"lm-fp32", "lm-fp16"}
    # eager's answer is transformers' own generate on the chat-templated prompt
    model = transformers.AutoModelForCausalLM.from_pretrained(trained / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained / "hf")
    ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": MESSAGE}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=m["greedy"]["new_tokens"], do_sample=False)[0, len(ids):].tolist()
    rows = {(r["runtime"], r["graph"]): r for r in m["greedy"]["rows"]}
    assert rows["eager PyTorch", "fp32"]["tokens"] == want
    assert {rt for rt, _ in rows} == {"eager PyTorch", "onnxruntime", "openvino-cpu", "qnn-htp-57"}
    assert {g for _, g in rows} == {"fp32", "fp32 npu", "fp16 npu", "fp32 npu-w8a16"}
    # every float graph on onnxruntime and OpenVINO gives eager's tokens; each row's count is its own leading run
    for (runtime, graph), r in rows.items():
        run = next((i for i, (a, b) in enumerate(zip(r["tokens"], want)) if a != b), len(want))
        assert r["leading_tokens_equal"] == run and r["text"] == tokenizer.decode(r["tokens"])
        assert (r["eager_margin"] is None) == (run == len(want))  # its value: the test below
        if runtime in ("onnxruntime", "openvino-cpu") and graph == "fp32 npu":
            assert r["tokens"] == want, (runtime, graph)
    readme = (bundle / "README.md").read_text()
    assert "## What it answers" in readme and f"| onnxruntime | fp32 npu | {len(want)} |" in readme


def _zero_logits(monkeypatch):
    """Planted fault: every runtime's logits all zero (its greedy picks token 0); returns the real runner."""
    from runtime import verify
    real = verify._runner

    def zero_logits(bundle_, graph, runtime):
        run = real(bundle_, graph, runtime)
        return lambda feeds: {k: (np.zeros_like(v) if k == "logits" else v) for k, v in run(feeds).items()}
    monkeypatch.setattr(verify, "_runner", zero_logits)
    return real


def test_the_answer_table_gives_eager_margin_where_a_runtime_leaves_it(trained, monkeypatch):
    # planted fault: OpenVINO's logits all zero, so it answers token 0 every step; its rows must leave eager's tokens
    # at eager's first non-0 token, with eager's own lead there over token 0 (transformers' logits) as the margin
    import torch
    import transformers
    from export import handoff
    from models import AttentionConfig, build_model
    bundle = trained / "handoff"
    m = json.loads((bundle / "manifest.json").read_text())
    _zero_logits(monkeypatch)
    config = AttentionConfig.from_dict(m["config"])
    text = handoff.greedy_texts(bundle, m["graphs"], build_model(config, "lm", 0, m["weights"]), ["openvino-cpu"],
                                log=lambda *_: None)
    want = text["rows"][0]["tokens"]
    model = transformers.AutoModelForCausalLM.from_pretrained(m["weights"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(m["weights"])
    ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text["chat"]}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids + want])).logits[0, len(ids) - 1:-1]
    first = next(i for i, t in enumerate(want) if t != 0)
    rows = [r for r in text["rows"] if r["runtime"] == "openvino-cpu"]
    assert rows and all(r["tokens"] == [0] * len(want) and r["leading_tokens_equal"] == first for r in rows)
    for r in rows:
        assert r["eager_margin"] == pytest.approx(float(logits[first, want[first]] - logits[first, 0]), abs=1e-4)
        assert r["eager_margin"] > 0
    assert text["rows"][0]["eager_margin"] is None


def test_the_greedy_count_refuses_a_graph_with_zero_logits(trained, monkeypatch):
    # planted fault: a runtime whose logits are all zero picks token 0 every step; the table must say it differs
    from runtime import verify
    bundle = trained / "handoff"
    m = json.loads((bundle / "manifest.json").read_text())
    pair = {g["step"]: g for g in m["graphs"] if g["file"].startswith("lm-fp32/") and g["target"] == "npu"
            and g["window"] == 64}
    real = _zero_logits(monkeypatch)
    prompt = [1, 5, 9]
    got = verify.greedy(bundle, pair, "openvino-cpu", prompt, 8)
    monkeypatch.setattr(verify, "_runner", real)
    assert got == [0] * 8 and got != verify.greedy(bundle, pair, "openvino-cpu", prompt, 8)


def _shipped_copy(trained, tmp_path) -> tuple[Path, dict]:
    copy = tmp_path / "handoff"
    shutil.copytree(trained / "handoff", copy)
    return copy, json.loads((copy / "manifest.json").read_text())


def test_the_npu_graphs_ship_in_one_weight_shared_binary_per_kind_and_scheme(trained, tmp_path):
    """Per SoC: every float npu graph (fp32 and fp16, both steps, every window) in one binary holding the weights once,
    the QDQ graphs in another; a wrapper per graph naming its graph in it, each proven equal to a run single-graph
    context (the emulator loads no binary of several graphs)."""
    from runtime.qnn_binary import binary_info
    bundle = trained / "handoff"
    m = json.loads((bundle / "manifest.json").read_text())
    binaries = m["qnn"]["binaries"]
    assert set(binaries) == {"qnn57/lm.float.bin", "qnn57/lm.w8a16.bin"}
    npu = [g for g in m["graphs"] if g["target"].startswith("npu")]
    assert all(g["qnn"]["57"]["check"] == verify.PROVEN for g in npu) and m["qnn"]["checked"][verify.PROVEN] == len(npu)
    for name, record in binaries.items():
        members = [g for g in npu if g["qnn"]["57"]["binary"] == name]
        info = binary_info(bundle / name)
        assert record["graphs"] == len(info["graphs"]) == len(members) and record["sha256"] == qnn.sha256(bundle / name)
        assert {g["qnn"]["57"]["graph"] for g in members} == {g["name"] for g in info["graphs"]}
        assert sorted(record["wrappers"]) == sorted(g["qnn"]["57"]["wrapper"] for g in members)
    floats = [g for g in npu if g["qnn"]["57"]["binary"] == "qnn57/lm.float.bin"]
    assert len(floats) == 8  # fp32 and fp16, prefill and decode, windows 32 and 64
    # the weights once (fp16 on the HTP: the fp16 graphs' own weights file), not once per graph
    fp16 = (bundle / "lm-fp16/weights.data").stat().st_size
    assert fp16 < binaries["qnn57/lm.float.bin"]["bytes"] < len(floats) * fp16 / 2, (binaries, fp16)
    # and once for the fp32 and the fp16 graphs together: the fp16 graphs' binary alone, twice over, less their weights
    halves = [g for g in floats if g["dtype"] == "fp16"]
    alone = qnn.compile_shared([bundle / g["file"] for g in halves], 57, [tmp_path / f"{i}.onnx" for i in range(4)],
                               "fp16.bin", [True] * 4)
    assert binaries["qnn57/lm.float.bin"]["bytes"] < 2 * alone["bytes"] - fp16 / 2, (binaries, alone["bytes"], fp16)
    shipped = sorted(p.relative_to(bundle).as_posix() for p in (bundle / "qnn57").iterdir())
    assert shipped == sorted([*binaries, *(g["qnn"]["57"]["wrapper"] for g in npu)])


def _point(wrapper: Path, graph: str | None = None, binary: str | None = None) -> None:
    """Planted: the wrapper's EPContext node names another graph or binary."""
    model = onnx.load(wrapper)
    for a in model.graph.node[0].attribute:
        if a.name == "partition_name" and graph:
            a.s = graph.encode()
        if a.name == "ep_cache_context" and binary:
            a.s = binary.encode()
    onnx.save(model, wrapper)


def test_verify_refuses_what_a_shipped_binary_or_wrapper_was_not_built_as(trained, tmp_path, capsys):
    """Planted into copies of a shipped bundle, each refused on the HTP before anything runs: a wrapper naming another
    window's graph, a binary whose sha256 is not the manifest's, a truncated binary and a foreign one (the manifest's
    sha256 made theirs, as a rebuilt manifest would have it)."""
    runtime = "qnn-htp-57"

    def refused(copy, m, file) -> str:
        graph = next(g for g in m["graphs"] if g["file"] == file)
        r = verify_graph(copy, graph, runtime)
        assert not r["ok"] and r["load_error"].startswith("BinaryError: "), r
        return r["load_error"]

    def rehash(copy, m, name) -> None:
        for g in m["graphs"]:
            for c in g.get("qnn", {}).values():
                c["sha256"] = qnn.sha256(copy / name) if c["binary"] == name else c["sha256"]

    copy, m = _shipped_copy(trained, tmp_path / "window")
    small, large = (next(g for g in m["graphs"] if g["file"] == f"lm-fp32/decode.npu{w}.onnx") for w in (".w32", ""))
    _point(copy / small["qnn"]["57"]["wrapper"], graph=large["qnn"]["57"]["graph"])
    assert "are not decode.npu.w32.onnx's" in refused(copy, m, small["file"])

    copy, m = _shipped_copy(trained, tmp_path / "sha")
    with open(copy / "qnn57/lm.float.bin", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert "the binary changed after the bundle was built" in refused(copy, m, "lm-fp16/prefill.npu.onnx")
    m["graphs"] = [g for g in m["graphs"] if g["window"] == 32]  # the CLI over the small window's graphs: all FAIL
    (copy / "manifest.json").write_text(json.dumps(m))
    assert verify_main([str(copy)]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 4 and all(line.startswith(f"FAIL  {runtime}") and "did not load: BinaryError: " in line
                                   for line in fails), fails

    copy, m = _shipped_copy(trained, tmp_path / "truncated")
    binary = copy / "qnn57/lm.float.bin"
    binary.write_bytes(binary.read_bytes()[:4096])
    rehash(copy, m, "qnn57/lm.float.bin")
    assert "does not read it as a QNN context binary" in refused(copy, m, "lm-fp32/decode.npu.onnx")

    copy, m = _shipped_copy(trained, tmp_path / "foreign")
    shutil.copy(copy / "qnn57/lm.w8a16.bin", copy / "qnn57/lm.float.bin")
    rehash(copy, m, "qnn57/lm.float.bin")
    assert "which lm.float.bin does not hold" in refused(copy, m, "lm-fp32/decode.npu.onnx")
