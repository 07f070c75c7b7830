"""Whole transformers causal LMs (Llama, Qwen3, Gemma-2 with soft-capping and sliding windows), exported by
torch.onnx at static shapes: every layer's attention fuses, on `ort` into GroupQueryAttention (their masks are
computed from constants at run time, and evaluated), with the logits of eager PyTorch."""
import collections

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from corpus.hf import causal_lm
from export.torch_export import export_module
from passes.leftovers import unfused_attention
from passes.pipeline import run_pipeline

LAYERS = 2
_exports = {}


def exported(family):
    if family not in _exports:
        model = causal_lm(family, LAYERS)
        ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
        graph = export_module(model, (ids,), ["input_ids"], ["logits"])
        with torch.no_grad():
            want = model(ids).numpy()
        _exports[family] = (ir.serde.serialize_model(graph), ids.numpy(), want)
    proto, ids, want = _exports[family]
    return ir.serde.deserialize_model(proto), ids, want


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_every_layer_fuses(family, target):
    model, ids, want = exported(family)
    report = run_pipeline(model, target)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["Softmax"] == 0 and not unfused_attention(model, report["passes"]), report
    fused = [n for n in model.graph if n.op_type == ("GroupQueryAttention" if target == "ort" else "Attention")]
    assert len(fused) == LAYERS, ops
    if family == "gemma2":
        assert all(n.attributes["softcap"].value == 2.0 for n in fused)
        if target == "ort":  # alternate layers attend within a sliding window of 6
            assert sorted(n.attributes.get("local_window_size", ir.AttrInt64("w", 0)).value for n in fused) == [0, 6]
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids})[0]
    err = float(np.abs(got - want).max())
    print(f"{family} {target}: {len(fused)}/{LAYERS} layers fused, logits max abs {err:.1e}")
    assert err < 1e-4
