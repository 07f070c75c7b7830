"""One pipeline per target: a list of passes you can read, run in order, each reporting what it did.

A pass that crashes does not take the pipeline down: the graph goes back to what it was
before that pass (a clone taken before it, which shares the weights), the report says why,
and the next pass runs.
"""
from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from .base import NotFused, failure, node_count
from .cleanup import Cleanup
from .einsum_to_matmul import EinsumToMatMul
from .fix_dims import FixDims
from .fuse_attention import FuseAttention
from .fuse_cache_write import FuseCacheWrite
from .fuse_rmsnorm import FuseRMSNorm
from .fold_rope_gqa import FoldRoPEIntoGQA
from .fuse_rope import FuseRoPE
from .lower_gqa import LowerToGQA
from .lower_npu import LowerNPU
from .pack_matmuls import PackMatMuls
from .pack_qkv import PackQKV
from .quantize_blocks import QuantizeBlocks
from .upgrade_opset import UpgradeOpset

OPSET = 24


def passes_for(target: str, fix_dims: dict[str, int] | None = None) -> list:
    """The target's passes; `fix_dims` pins symbolic dims by name (see fix_dims.py)."""
    def front():
        return [FixDims(fix_dims or {}), Cleanup()]

    def fuse(flavour):
        return [UpgradeOpset(OPSET), EinsumToMatMul(), FuseRMSNorm(flavour), FuseRoPE(flavour), FuseAttention(),
                FuseCacheWrite(), Cleanup()]

    pipelines = {
        "raw": lambda: front(),
        "onnx": lambda: front() + fuse("onnx"),
        "ort": lambda: front() + fuse("ort") + [LowerToGQA(), Cleanup(), FoldRoPEIntoGQA(), PackMatMuls(), PackQKV(),
                                                Cleanup()],
    }
    pipelines["npu"] = lambda: pipelines["onnx"]() + [LowerNPU(), Cleanup()]
    for scheme, quantizer in WEIGHT_ONLY.items():
        pipelines[f"ort-{scheme}"] = lambda q=quantizer: pipelines["ort"]() + [q()]
    if target not in pipelines:
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(pipelines)}")
    return pipelines[target]()


TARGETS = ("raw", "onnx", "ort", "npu")
# Weight-only schemes of the ort target (quantize_blocks.py), chosen by measurement on this machine's CPU
# (docs/quantization.md): int4 in blocks of 32 with a scale and a minimum each (a trained checkpoint's Q4_1 weights held
# exactly; the lm_head int8), int8 symmetric in blocks of 32 (SmolLM2-135M's decode step: KL 0.0036 where onnxruntime's
# blocks of 128 measured 0.020, 7% slower); accuracy level 4 (int8 compute; level 0 makes int4 3x and int8 30x slower).
WEIGHT_ONLY = {"int4": lambda: QuantizeBlocks(4, accuracy_level=4), "int8": lambda: QuantizeBlocks(8, accuracy_level=4)}


def run_pipeline(model: ir.Model, target: str, dump_dir: str | Path | None = None, log=None,
                 fix_dims: dict[str, int] | None = None) -> dict:
    """Run the target's passes on `model` in place; return the report (one entry per pass)."""
    report = []
    for i, p in enumerate(passes_for(target, fix_dims)):
        before = model.graph.clone()
        try:
            p(model)
            entry = p.report()
        except Exception as e:  # the pass as a whole could not run: undo it, say why, go on
            model.graph = before
            entry = _failed(p, model, str(e) if isinstance(e, NotFused) else failure(e))
        report.append(entry)
        if log:
            log(entry["summary"])
        if dump_dir is not None:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            ir.save(model, Path(dump_dir) / f"{i:02d}-{p.name}.onnx")
    return {"target": target, "passes": report}


def _failed(p, model: ir.Model, reason: str) -> dict:
    nodes = node_count(model)
    return {"pass": p.name, "summary": f"{p.name}: not applied, {reason} ({nodes} -> {nodes} nodes)",
            "nodes_before": nodes, "nodes_after": nodes, "stats": {"not_applied": 1},
            "not_matched": [{"node": "", "op": "", "reason": reason}]}
