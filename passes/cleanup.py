"""cleanup: constant folding, onnxscript's basic algebraic rules (Transpose pairs, Reshape
chains, no-op casts), dead-node removal and a topological sort."""
from __future__ import annotations

import contextlib

import onnx_ir as ir
import onnxscript.optimizer
from onnxscript import rewriter
from onnxscript.rewriter.rules.common import _no_op

from .base import GraphPass, node_count


MAX_ROUNDS = 8
# onnxscript's no-op rules match their constant within a tolerance (x + c for |c| <= 1e-8, x * c for c within 1e-5
# of 1), so they deleted a real epsilon: Helium's RMSNorm adds 1e-8 before its sqrt, and without it a zero row divides
# by zero. Cleanup runs onnxscript's default rules without those (all its no-op rules but the exact Dropout ones).
INEXACT_RULES = tuple(r for r in _no_op.rules if r not in (_no_op.dropout_zero_rule, _no_op.dropout_inference_rule))


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, model: ir.Model) -> bool:
        before = count = node_count(model)
        for _ in range(MAX_ROUNDS):  # to a fixed point, so a second cleanup finds nothing left
            with _exact_rules():
                onnxscript.optimizer.optimize_ir(model, num_iterations=2)
            ir.passes.common.RemoveUnusedNodesPass()(model)
            if node_count(model) == count:
                break
            count = node_count(model)
        ir.passes.common.RemoveUnusedOpsetsPass()(model)
        ir.passes.common.TopologicalSortPass()(model)
        self.stats["removed"] = before - node_count(model)
        return False  # GraphPass reports a change when the node count moved


@contextlib.contextmanager
def _exact_rules():
    """optimize_ir reads onnxscript's default rule list when it runs (a private name of the pinned onnxscript)."""
    saved = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in saved if r not in INEXACT_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = saved
