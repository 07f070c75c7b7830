"""pack_qkv: GroupQueryAttention reads the packed q/k/v product whole where the Split before it is exactly q, k, v;
anything else (a q/k norm between, parts out of order) keeps the Split and says why."""
import onnx_ir as ir

from export import export_model
from export.torch_export import to_onnx
from models import build_model, preset
from passes.pack_qkv import PackQKV
from passes.pipeline import passes_for


def _report(manifest, step="decode"):
    g = next(g for g in manifest["graphs"] if g["step"] == step and g["target"] == "ort")
    return next(p for p in g["passes"] if p["pass"] == "pack_qkv")


def test_packed_where_the_split_is_q_k_v(tmp_path):
    config = preset("tiny", qk_norm=False)
    m = export_model(config, tmp_path / "plain", kind="lm", targets=("ort",), log=lambda *_: None)  # parity-checked
    for step in ("prefill", "decode"):
        assert _report(m, step)["stats"]["packed"] == config.num_layers


def test_a_qk_norm_between_keeps_the_split(tmp_path):
    m = export_model(preset("tiny"), tmp_path / "norm", kind="lm", targets=("ort",), log=lambda *_: None)
    report = _report(m)
    assert report["stats"].get("packed", 0) == 0
    assert {n["reason"] for n in report["not_matched"]} == {"query, key and value are not the outputs of one Split"}


def test_parts_out_of_order_are_not_packed():
    # planted fault: key and value swapped at the attention; packing would hand it the parts in the Split's order
    config = preset("tiny", qk_norm=False)
    model = to_onnx(build_model(config, "lm", seed=0), config, 1, 20, "lm")
    for p in passes_for("ort")[:-2]:  # up to pack_matmuls: the attention reads the three parts of one Split
        p(model)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    k, v = node.inputs[1], node.inputs[2]
    node.replace_input_with(1, v)
    node.replace_input_with(2, k)
    p = PackQKV()
    p(model)
    assert p.stats["packed"] == config.num_layers - 1
    assert "the Split's outputs are not query, key and value in that order" in {n["reason"] for n in p.notes}
