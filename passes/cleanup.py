"""cleanup: constant folding, onnxscript's basic algebraic rules (Transpose pairs, Reshape
chains, no-op casts), dead-node removal and a topological sort."""
from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer

from .base import GraphPass, node_count


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, model: ir.Model) -> bool:
        before = node_count(model)
        onnxscript.optimizer.optimize_ir(model, num_iterations=2)
        ir.passes.common.RemoveUnusedNodesPass()(model)
        ir.passes.common.RemoveUnusedOpsetsPass()(model)
        ir.passes.common.TopologicalSortPass()(model)
        self.stats["removed"] = before - node_count(model)
        return False  # GraphPass reports a change when the node count moved
