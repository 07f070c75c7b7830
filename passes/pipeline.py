"""One pipeline per target: a list of passes you can read, run in order, each reporting what it did.

A pass that crashes does not take the pipeline down: the graph goes back to what it was
before that pass (a clone taken before it, which shares the weights), the report says why,
and the next pass runs.
"""
from __future__ import annotations

import copy
from pathlib import Path

import onnx_ir as ir

import registry

from .base import NotFused, failure, node_count

TARGETS = registry.float_targets()  # what an export makes unless told (registry.py)


def lineage(target: str) -> list[str]:
    """The targets whose passes make `target`'s, first to last: ort-int4 -> [raw, ort, ort-int4]; a target the
    pipelines make (registry.pipeline_targets: the float ones, and those whose scheme is a pass)."""
    if target not in registry.pipeline_targets():
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(registry.pipeline_targets())}")
    return registry.lineage(target)


def _own(target: str, fix_dims: dict[str, int] | None) -> list:
    return registry.target(target).passes(fix_dims or {})


def passes_for(target: str, fix_dims: dict[str, int] | None = None) -> list:
    """The target's passes; `fix_dims` pins symbolic dims by name (see fix_dims.py)."""
    return [p for t in lineage(target) for p in _own(t, fix_dims)]


def run_pipeline(model: ir.Model, target: str, dump_dir: str | Path | None = None, log=None,
                 fix_dims: dict[str, int] | None = None) -> dict:
    """Run the target's passes on `model` in place; return the report (one entry per pass)."""
    return {"target": target, "passes": _run(model, passes_for(target, fix_dims), dump_dir, log)}


def run_pipelines(model: ir.Model, targets, fix_dims: dict[str, int] | None = None) -> dict[str, tuple[ir.Model, dict]]:
    """{target: (its graph, its report)} for each of `targets`, from `model` (left as it is), each pass a lineage
    shares run once: raw's passes begin every target's, onnx's npu's, ort's its quantized targets'; a branch goes on
    from a clone of its parent's graph (weights shared). The same graphs and reports as run_pipeline per target."""
    done = {}
    for target in dict.fromkeys(t for target in targets for t in lineage(target)):
        parent = registry.target(target).parent
        graph = _branch(done[parent][0] if parent else model)
        done[target] = (graph, {"target": target, "passes": (done[parent][1]["passes"] if parent else [])
                                + _run(graph, _own(target, fix_dims))})
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
