"""One pipeline per target: a list of passes you can read, run in order, each reporting what it did.

A pass that crashes does not take the pipeline down: the graph goes back to what it was
before that pass (a clone taken before it, which shares the weights), the report says why,
and the next pass runs.
"""
from __future__ import annotations

import copy
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


def _own_passes(fix_dims: dict[str, int] | None) -> dict[str, tuple[str | None, list]]:
    """Each target's parent and the passes it adds to the parent's: a target's pipeline is its parent's, then these."""
    def fuse(flavour):
        return [UpgradeOpset(OPSET), EinsumToMatMul(), FuseRMSNorm(flavour), FuseRoPE(flavour), FuseAttention(),
                FuseCacheWrite(), Cleanup()]
    own = {
        "raw": (None, [FixDims(fix_dims or {}), Cleanup()]),
        "onnx": ("raw", fuse("onnx")),
        "ort": ("raw", fuse("ort") + [LowerToGQA(), Cleanup(), FoldRoPEIntoGQA(), PackMatMuls(), PackQKV(), Cleanup()]),
        "npu": ("onnx", [LowerNPU(), Cleanup()]),
    }
    return own | {f"ort-{scheme}": ("ort", [quantizer()]) for scheme, quantizer in WEIGHT_ONLY.items()}


def lineage(target: str) -> list[str]:
    """The targets whose passes make `target`'s, first to last: ort-int4 -> [raw, ort, ort-int4]."""
    own = _own_passes(None)
    if target not in own:
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(own)}")
    return (lineage(own[target][0]) if own[target][0] else []) + [target]


def passes_for(target: str, fix_dims: dict[str, int] | None = None) -> list:
    """The target's passes; `fix_dims` pins symbolic dims by name (see fix_dims.py)."""
    own = _own_passes(fix_dims)
    return [p for t in lineage(target) for p in own[t][1]]


TARGETS = ("raw", "onnx", "ort", "npu")
# Weight-only schemes of the ort target (quantize_blocks.py), chosen by measurement on this machine's CPU
# (docs/quantization.md): int4 in blocks of 32 with a scale and a minimum each (a trained checkpoint's Q4_1 weights held
# exactly; the lm_head int8), int8 symmetric in blocks of 32 (SmolLM2-135M's decode step: KL 0.0036 where onnxruntime's
# blocks of 128 measured 0.020, 7% slower); accuracy level 4 (int8 compute; level 0 makes int4 3x and int8 30x slower).
WEIGHT_ONLY = {"int4": lambda: QuantizeBlocks(4, accuracy_level=4), "int8": lambda: QuantizeBlocks(8, accuracy_level=4)}


def run_pipeline(model: ir.Model, target: str, dump_dir: str | Path | None = None, log=None,
                 fix_dims: dict[str, int] | None = None) -> dict:
    """Run the target's passes on `model` in place; return the report (one entry per pass)."""
    return {"target": target, "passes": _run(model, passes_for(target, fix_dims), dump_dir, log)}


def run_pipelines(model: ir.Model, targets, fix_dims: dict[str, int] | None = None) -> dict[str, tuple[ir.Model, dict]]:
    """{target: (its graph, its report)} for each of `targets`, from `model` (left as it is), each pass a lineage
    shares run once: raw's passes begin every target's, onnx's npu's, ort's its quantized targets'; a branch goes on
    from a clone of its parent's graph (weights shared). The same graphs and reports as run_pipeline per target."""
    own, done = _own_passes(fix_dims), {}
    for target in dict.fromkeys(t for target in targets for t in lineage(target)):
        parent = own[target][0]
        graph = _branch(done[parent][0] if parent else model)
        done[target] = (graph, {"target": target, "passes": (done[parent][1]["passes"] if parent else [])
                                + _run(graph, own[target][1])})
    return {t: done[t] for t in targets}


def _branch(model: ir.Model) -> ir.Model:
    """A clone to run more passes on: its own Builder log, its node names numbered on from the model's."""
    clone = model.clone()
    clone.meta.pop("builder_log", None)
    if "builder_ids" in model.meta:
        clone.meta["builder_ids"] = copy.copy(model.meta["builder_ids"])
    return clone


def _run(model: ir.Model, passes: list, dump_dir: str | Path | None = None, log=None) -> list[dict]:
    report = []
    for i, p in enumerate(passes):
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
    return report


def _failed(p, model: ir.Model, reason: str) -> dict:
    nodes = node_count(model)
    return {"pass": p.name, "summary": f"{p.name}: not applied, {reason} ({nodes} -> {nodes} nodes)",
            "nodes_before": nodes, "nodes_after": nodes, "stats": {"not_applied": 1},
            "not_matched": [{"node": "", "op": "", "reason": reason}]}
