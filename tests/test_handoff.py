"""make handoff: the bundle lints clean, verifies from the bundle alone, and says which runtime takes what."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from export.handoff import build
from models import preset
from runtime.verify import main as verify_main

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
    assert m["runtimes"]["onnxruntime"] == {"onnx": True, "npu": True, "npu-w8a16": True}
    # OpenVINO 2026.4 has no TensorScatter, nor has QNN's HTP; both run the QDQ graphs within their budget.
    assert m["runtimes"]["openvino-cpu"] == {"onnx": False, "npu": True, "npu-w8a16": True}
    assert m["runtimes"]["qnn-htp-57"] == {"onnx": False, "npu": True, "npu-w8a16": True}
    qdq = [g for g in m["graphs"] if g["target"] == "npu-w8a16"]
    assert {g["file"] for g in qdq} == {f"lm-fp32/{s}.npu-w8a16.onnx" for s in ("prefill", "decode")}
    assert all(g["quantized"]["scheme"] == "w8a16" and g["tolerance"] == g["quantized"]["budget_max_rel"] for g in qdq)
    assert all(g["qnn"]["57"]["fp16_precision"] is False and not g["qnn"]["57"]["placement"]["unsupported"] for g in qdq)
    assert m["qnn"]["socs"] == [57] and m["qnn"]["version"].startswith("QNN 2.51")
    for g in (g for g in m["graphs"] if g["target"] == "npu"):  # compiled, every node on the HTP
        compiled = g["qnn"]["57"]
        assert (bundle / compiled["file"]).is_file() and compiled["soc_model"] == 57
        assert compiled["placement"]["htp_nodes"] > 10 and compiled["placement"]["unsupported"] == []
    assert "| 57 | SM8650 (Snapdragon 8 Gen 3, HTP v75) | `*.npu.qnn57.onnx` |" in (bundle / "README.md").read_text()
    assert "openvino-cpu: `onnx` no, `npu` yes" in (bundle / "README.md").read_text()
    golden = np.load(bundle / "attention-fp32/decode.npu.golden.npz")
    assert int(golden["steps"]) == 8 and golden["in.0.position_ids"].dtype == np.int32
    lm = np.load(bundle / "lm-fp32/decode.npu.golden.npz")  # token ids in, greedy tokens stored, caches left out
    assert lm["in.0.input_ids"].dtype == np.int32 and lm["out.0.greedy"].shape == (1, 1)
    past = [k for k in lm.files if "past_" in k]  # but the prompt chunk's rows, which the decode steps read
    assert len(past) == 4 and all(k.startswith("in.0.") and lm[k].shape == (1, 2, 16, 16) for k in past)
    assert lm["out.7.key.1"].shape == (1, 2, 1, 16)


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
    assert len(htp) == 14 and sum(".qnn57.onnx, fp16 on the HTP" in line for line in htp) == 12
    assert sum(".qnn57.onnx, quantized on the HTP (budget 0.3)" in line for line in htp) == 2
    assert [line for line in lines if "lm-fp32/decode.npu.onnx" in line][0].endswith("greedy top-1 100%")


def test_verify_catches_a_wrong_golden(bundle, tmp_path, capsys):
    import shutil
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    path = copy / "block-fp32/decode.npu.golden.npz"
    data = dict(np.load(path))
    data["out.3.output"] = data["out.3.output"] + 0.01
    np.savez(path, **data)
    assert verify_main([str(copy)]) == 1
    assert "FAIL  onnxruntime  block-fp32/decode.npu.onnx" in capsys.readouterr().out


def test_verify_refuses_a_folder_that_is_no_bundle(tmp_path, capsys):
    assert verify_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}: no readable manifest.json") and err.count("\n") == 1


def test_fully_masked_rows_stay_finite_in_fp16(bundle):
    """The mask is finite by design: even a row with nothing visible gives numbers, not NaN."""
    import onnxruntime as ort
    golden = np.load(bundle / "attention-fp16/decode.npu.golden.npz")
    feeds = {k.split(".", 2)[2]: golden[k] for k in golden.files if k.startswith("in.0.")}
    feeds["attention_mask"] = np.full_like(feeds["attention_mask"], -30000.0)
    out = ort.InferenceSession(str(bundle / "attention-fp16/decode.npu.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert all(np.isfinite(o.astype(np.float32)).all() for o in out)


def test_a_bundle_carries_the_window_ladder(tmp_path, capsys):
    """Every graph over each window, with its own goldens (cache and mask W rows wide), verified from the bundle."""
    out = tmp_path / "handoff"
    build(preset("tiny"), out, kinds=("attention", "lm"), socs=(), windows=(32, 64), log=lambda *_: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["windows"] == [32, 64]
    small = {g["file"]: g for g in m["graphs"] if g["window"] == 32}
    assert set(small) == {f"attention-{d}/{s}.{t}.w32.onnx" for d, ts in (("fp32", ("npu", "onnx")), ("fp16", ("npu",)))
                          for t in ts for s in ("prefill", "decode")} | \
        {f"lm-{d}/{s}.npu.w32.onnx" for d in ("fp32", "fp16") for s in ("prefill", "decode")}  # QDQ: C only
    golden = np.load(out / "attention-fp32/decode.npu.w32.golden.npz")
    assert golden["in.0.past_key"].shape[2] == 32 and golden["in.0.attention_mask"].shape[-1] == 33
    assert small["lm-fp32/decode.npu.w32.onnx"]["host_cache"]["shape"][2] == 32
    assert verify_main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("pass  onnxruntime") and ".w32." in line for line in lines) == len(small)


def test_a_window_too_small_for_the_goldens_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"windows \[16\]: a golden holds a prefill chunk and 8 decode steps; "
                                         r"expected W >= 24"):
        build(preset("tiny"), tmp_path / "h", socs=(), windows=(16, 64), log=lambda *_: None)
    assert not (tmp_path / "h").exists()
