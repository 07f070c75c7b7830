"""What `python -m export` writes: two static graphs in the step contract, and a manifest that describes them."""
import json
import re
import subprocess
import sys
from pathlib import Path

import onnx
import onnx.helper as oh
import pytest

import export.exporter
import passes.model_io
from export import ParityError, export_model
from passes.static_shapes import StaticShapeError, check_static
from models import preset
from models.contract import INPUTS, OUTPUTS
from conftest import prepacks

NPU_INPUTS = ("hidden_states", "position_ids", "attention_mask", "past_key", "past_value")
NPU_OUTPUTS = ("output", "key", "value")

ROOT = Path(__file__).resolve().parents[1]


def test_artifacts_and_manifest(exported):
    art = exported("block")
    names = sorted(p.name for p in art.folder.iterdir())
    assert names == sorted(["manifest.json"] + [f"{s}.{t}.onnx" for s in ("prefill", "decode")
                                                for t in ("raw", "onnx", "ort", "npu")])
    m = json.loads((art.folder / "manifest.json").read_text())
    assert m == art.manifest
    assert m["kind"] == "block" and m["config"] == art.config.to_dict() and m["opset"] == 20
    assert m["cache"]["layout"] == "[B, Hkv, C, D]" and m["cache"]["shape"] == [1, 2, 64, 16]
    assert m["weights"]["checksum"].startswith("sha256:")
    for g in m["graphs"]:
        t = 16 if g["step"] == "prefill" else 1
        model = onnx.load(str(art.folder / g["file"]))
        inputs, outputs = (NPU_INPUTS, NPU_OUTPUTS) if g["target"] == "npu" else (INPUTS, OUTPUTS)
        assert [i.name for i in model.graph.input] == list(inputs) == [s["name"] for s in g["inputs"]]
        assert [o.name for o in model.graph.output] == list(outputs) == [s["name"] for s in g["outputs"]]
        assert [list(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input] == \
            [s["shape"] for s in g["inputs"]]
        assert g["inputs"][0]["shape"] == [1, t, 64] and g["file"] == f"{g['step']}.{g['target']}.onnx"
        assert 0 <= g["parity"]["max_abs"] < 1e-4 and len(g["parity"]["cases"]) == 3
        assert [p["pass"] for p in g["passes"]][:2] == ["fix_dims", "cleanup"]
    for target, seq in m["sequence_parity"]["targets"].items():
        assert seq["decode_steps"] == 16 and seq["max_abs"] < 1e-4


@pytest.mark.parametrize("kind", ["attention", "block"])
@pytest.mark.parametrize("target", ["raw", "onnx", "ort", "npu"])
def test_every_tensor_is_static(exported, kind, target):
    art = exported(kind, batch=2, dtype="fp16")
    for step in ("prefill", "decode"):
        assert check_static(art.folder / f"{step}.{target}.onnx", strict=target != "ort") > 20


def test_static_check_rejects_a_symbolic_dim(tmp_path):
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    model = oh.make_model(oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[oh.make_opsetid("", 20)])
    onnx.save(model, tmp_path / "dyn.onnx")
    with pytest.raises(StaticShapeError, match="x: \\['batch', 4\\]"):
        check_static(tmp_path / "dyn.onnx")


def test_cli_exports(tmp_path):
    """End to end through the CLI that `make export` runs (the minimind preset is make export's own run)."""
    out = tmp_path / "tiny"
    res = subprocess.run([sys.executable, "-m", "export", "--preset", "tiny", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    # a line per step as its graphs are saved; per target, a line per graph as it is checked ([k/8]) and its
    # sequence parity; the folder, the manifest, the time, the process's own peak memory
    assert len(lines) == 18 and lines[0].startswith("prefill over 64 rows: 4 graph(s) saved")
    assert re.fullmatch(r"peak memory: \d+\.\d\d GiB", lines.pop())
    lines = lines[2:]
    assert lines[0].startswith("[1/8] prefill.raw.onnx") and "parity vs eager max rel" in lines[0]
    assert lines[2].startswith("raw: sequence parity") and lines[-1].startswith("time: ")
    assert "trace" in lines[-1] and "passes" in lines[-1]
    assert "fuse_attention: 1 fused, 0 unfused" in lines[3] and "lower_gqa: 1 fused, 0 unfused" in lines[6]
    m = json.loads((out / "manifest.json").read_text())
    assert m["graphs"][0]["inputs"][0]["shape"] == [1, 16, 64]
    assert m["graphs"][1]["inputs"][2]["shape"] == [1, 2, 64, 16]
    assert max(g["parity"]["max_abs"] for g in m["graphs"]) < 1e-4


def test_large_weights_go_to_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(passes.model_io, "EXTERNAL_DATA_BYTES", 0)
    m = export_model(preset("tiny"), tmp_path, targets=("raw",), log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode.raw.onnx", "decode.raw.onnx.data", "manifest.json", "prefill.raw.onnx", "prefill.raw.onnx.data"]
    assert m["graphs"][0]["external_data"] == "prefill.raw.onnx.data"
    assert (tmp_path / "prefill.raw.onnx").stat().st_size < m["graphs"][0]["bytes"] / 2


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    """A parity failure after the graphs were written: a new folder disappears, an old one is untouched."""
    monkeypatch.setattr(export.exporter, "per_output", lambda errors, budgets: ("output", "planted"))
    with pytest.raises(ParityError, match=r"prefill.raw.onnx: step parity against fp32 eager PyTorch: planted "
                                          r"\(output, p0=0\); expected"):
        export_model(preset("tiny"), tmp_path / "new", log=lambda *_: None)
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "prefill.raw.onnx").write_bytes(b"previous")
    with pytest.raises(ParityError):
        export_model(preset("tiny"), old, log=lambda *_: None)
    assert [p.name for p in old.iterdir()] == ["prefill.raw.onnx"] and (old / "prefill.raw.onnx").read_bytes() == b"previous"


def test_weights_change_the_graph(exported, tmp_path):
    """Same config, another seed: other weights, another checksum, other outputs."""
    a = exported()
    b = export_model(a.config, tmp_path, seed=1, log=lambda *_: None)
    assert a.manifest["weights"]["checksum"] != b["weights"]["checksum"]
    assert onnx.load(str(a.folder / "decode.raw.onnx")).graph.initializer != onnx.load(str(tmp_path / "decode.raw.onnx")).graph.initializer


def _mapped_bytes(path) -> int:
    """Bytes of `path` mapped into this process (/proc/self/maps)."""
    total = 0
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            total += end - start
    return total


def test_shared_weights_are_read_through_one_mapping(tmp_path):
    """Sessions given one SharedWeights read the weights file through one mapping: a second session maps nothing more,
    computes what a session with its own copy does, and reads the file itself (zeroing it changes what it computes)."""
    import numpy as np
    from runtime.artifacts import graph_entry
    from runtime.session import StepSession
    from runtime.shared_weights import SharedWeights
    m = export_model(preset("tiny"), tmp_path, kind="lm", targets=("onnx",), log=lambda *_: None)
    data, shared, opened = (tmp_path / "weights.data").resolve(), SharedWeights(), {}
    for step in ("prefill", "decode"):
        g = graph_entry(m, step, "onnx")
        opened[step] = StepSession(tmp_path / g["file"], g["inputs"], g["outputs"], provider="cpu", weights=shared)
        mapped = mapped if step == "decode" else _mapped_bytes(data)
    assert 0 < mapped == _mapped_bytes(data) and len(shared) > 0
    own = StepSession(tmp_path / graph_entry(m, "decode", "onnx")["file"], provider="cpu")
    rng = np.random.default_rng(0)
    feeds = {s["name"]: (rng.integers(0, 8, s["shape"]) if "int" in s["dtype"] else rng.standard_normal(s["shape"]))
             .astype(s["dtype"]) for s in opened["decode"].inputs}
    feeds["position_ids"] = np.zeros_like(feeds["position_ids"])
    before = opened["decode"].run(feeds)["logits"]
    assert np.allclose(before, own.run(feeds)["logits"], atol=1e-5) and np.abs(before).max() > 0
    with open(data, "r+b") as f:
        f.write(b"\0" * data.stat().st_size)
    assert not np.allclose(opened["decode"].run(feeds)["logits"], before, atol=1e-3)


def test_shared_weights_keep_packing_only_for_block_quantized_products(tmp_path):
    """A float graph's sessions read the mapping unpacked (a pre-packed weight is a private copy); one with MatMulNBits
    keeps pre-packing, without which onnxruntime dequantizes every block at every step (150x slower a product)."""
    import onnxruntime as ort
    from passes.quantize_blocks import QuantizeBlocks
    import onnx_ir as ir
    from passes.model_io import load
    from runtime.shared_weights import SharedWeights
    m = export_model(preset("tiny"), tmp_path / "f", kind="lm", targets=("onnx",), log=lambda *_: None)
    graph = tmp_path / "f" / next(g["file"] for g in m["graphs"] if g["step"] == "decode")
    model = load(graph)
    assert QuantizeBlocks(4, 4)(model) and any(n.op_type == "MatMulNBits" for n in model.graph)
    (tmp_path / "q").mkdir()
    ir.save(model, tmp_path / "q" / "decode.onnx", external_data="decode.onnx.data")

    def packing(path) -> bool:
        options = ort.SessionOptions()
        assert SharedWeights().share(options, path) > 0
        return prepacks(options)
    assert not packing(graph) and packing(tmp_path / "q" / "decode.onnx")


@pytest.mark.parametrize("threshold, collects", [(0, True), (1 << 50, False)])
def test_memory_is_released_only_from_a_large_process(monkeypatch, threshold, collects):
    """A full collection runs once the process holds RELEASE_ABOVE resident bytes (a 0.6B export's garbage), not in a
    small one, where it frees nothing and costs 0.25 s a call."""
    import gc
    import export.eager
    assert 10 << 20 < export.eager.resident_bytes() < 1 << 50
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(export.eager, "RELEASE_ABOVE", threshold)
    export.eager.release_memory()
    assert bool(calls) == collects
