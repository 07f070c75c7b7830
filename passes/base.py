"""The pass framework: onnx-ir in-place passes that count what they did and say why they did not.

Every pass keeps LLVM-style statistics (`stats`), notes on each candidate it left alone
(`notes`: node, op and the failed check), and node counts before and after.
"""
from __future__ import annotations

from collections import Counter

import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401 -- ir.passes.common, which `import onnx_ir` alone does not load

from .build import commit, rollback, transaction


class NotFused(Exception):
    """A candidate failed a check; the message names the check."""


class Skip(Exception):
    """Not a candidate after all (e.g. an Attention op with nothing left to fuse): counted as neither."""


def failure(e: Exception) -> str:
    """An unexpected exception as one line: a candidate (or pass) that crashed is reported, never raised."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"failed: {type(e).__name__}: {first}" if first else f"failed: {type(e).__name__}"


def node_count(model: ir.Model) -> int:
    return sum(1 for _ in model.graph.all_nodes())


class GraphPass(ir.passes.InPlacePass):
    name = "pass"
    min_opset = 0  # the default-domain opset the ops this pass emits need

    def __init__(self):
        super().__init__()
        self.stats: Counter = Counter()
        self.notes: list[dict] = []
        self.nodes = (0, 0)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.stats, self.notes = Counter(), []
        before = node_count(model)
        opset = model.opset_imports.get("", 0)
        if opset < self.min_opset:
            self.notes.append({"node": "", "op": "", "reason": f"graph is at opset {opset}; this pass emits ops of "
                                                                f"opset {self.min_opset} (upgrade_opset did not run)"})
            self.nodes = (before, before)
            return ir.passes.PassResult(model, False)
        modified = bool(self.run(model))
        self.nodes = (before, node_count(model))
        return ir.passes.PassResult(model, modified or self.nodes[0] != self.nodes[1])

    def run(self, model: ir.Model) -> bool:
        raise NotImplementedError

    def note(self, node: ir.Node, reason: str) -> None:
        self.notes.append({"node": node.name, "op": node.op_type, "reason": reason})

    def summary(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.stats.items()) or "nothing to do"
        return f"{self.name}: {counts} ({self.nodes[0]} -> {self.nodes[1]} nodes)"

    def report(self) -> dict:
        return {"pass": self.name, "summary": self.summary(), "nodes_before": self.nodes[0], "nodes_after": self.nodes[1],
                "stats": dict(self.stats), "not_matched": self.notes}


class FusionPass(GraphPass):
    """Tries `fuse` on every candidate node; counts `fused` and `unfused`, noting each failed check.

    A candidate is a transaction: `fuse` only adds nodes (through a Builder) until its last
    step rewires the graph, so a candidate that fails a check, or crashes, has its new nodes
    removed and leaves the graph as it was.
    """
    candidate_ops: tuple[str, ...] = ()
    domain = ""

    def run(self, model: ir.Model) -> bool:
        self.stats.update(fused=0, unfused=0)
        for node in [n for n in model.graph if n.op_type in self.candidate_ops and n.domain == self.domain]:
            if node.graph is None:  # removed by an earlier fusion in this run
                continue
            mark = transaction(model)
            try:
                self.fuse(model, node)
                commit(model, mark)
                self.stats["fused"] += 1
            except Skip:
                rollback(model, mark)
            except NotFused as e:
                rollback(model, mark)
                self.stats["unfused"] += 1
                self.note(node, str(e))
            except Exception as e:  # a candidate can fail; the pass, and the command, cannot
                rollback(model, mark)
                self.stats["unfused"] += 1
                self.note(node, failure(e))
        if self.stats["fused"]:
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return self.stats["fused"] > 0

    def fuse(self, model: ir.Model, node: ir.Node) -> None:
        raise NotImplementedError
