"""One pipeline per target: a list of passes you can read, run in order, each reporting what it did."""
from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from .cleanup import Cleanup
from .fuse_attention import FuseAttention
from .fuse_cache_write import FuseCacheWrite
from .fuse_rmsnorm import FuseRMSNorm
from .fold_rope_gqa import FoldRoPEIntoGQA
from .fuse_rope import FuseRoPE
from .lower_gqa import LowerToGQA
from .lower_npu import LowerNPU
from .pack_matmuls import PackMatMuls
from .upgrade_opset import UpgradeOpset

OPSET = 24


def passes_for(target: str) -> list:
    pipelines = {
        "raw": lambda: [Cleanup()],
        "onnx": lambda: [Cleanup(), UpgradeOpset(OPSET), FuseRMSNorm("onnx"), FuseRoPE("onnx"), FuseAttention(),
                         FuseCacheWrite(), Cleanup()],
        "ort": lambda: [Cleanup(), UpgradeOpset(OPSET), FuseRMSNorm("ort"), FuseRoPE("ort"), FuseAttention(),
                        FuseCacheWrite(), Cleanup(), LowerToGQA(), Cleanup(), FoldRoPEIntoGQA(), PackMatMuls(),
                        Cleanup()],
    }
    pipelines["npu"] = lambda: pipelines["onnx"]() + [LowerNPU(), Cleanup()]
    if target not in pipelines:
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(pipelines)}")
    return pipelines[target]()


TARGETS = ("raw", "onnx", "ort", "npu")


def run_pipeline(model: ir.Model, target: str, dump_dir: str | Path | None = None, log=None) -> dict:
    """Run the target's passes on `model` in place; return the report (one entry per pass)."""
    report = []
    for i, p in enumerate(passes_for(target)):
        p(model)
        report.append(p.report())
        if log:
            log(p.summary())
        if dump_dir is not None:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            ir.save(model, Path(dump_dir) / f"{i:02d}-{p.name}.onnx")
    return {"target": target, "passes": report}
