"""cleanup: constant folding, onnxscript's basic algebraic rules (Transpose pairs, Reshape
chains, no-op casts), dead-node removal and a topological sort."""
from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer

from .base import GraphPass, node_count


MAX_ROUNDS = 8


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, model: ir.Model) -> bool:
        before = count = node_count(model)
        for _ in range(MAX_ROUNDS):  # to a fixed point, so a second cleanup finds nothing left
            onnxscript.optimizer.optimize_ir(model, num_iterations=2)
            ir.passes.common.RemoveUnusedNodesPass()(model)
            if node_count(model) == count:
                break
            count = node_count(model)
        ir.passes.common.RemoveUnusedOpsetsPass()(model)
        ir.passes.common.TopologicalSortPass()(model)
        self.stats["removed"] = before - node_count(model)
        return False  # GraphPass reports a change when the node count moved
