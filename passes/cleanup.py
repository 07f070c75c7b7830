"""cleanup: constant folding, basic algebraic rules, dead-node removal and a topological sort.

cleanup: constant folding, onnxscript's basic algebraic rules (Transpose pairs, Reshape
chains, no-op casts), dead-node removal and a topological sort.

Constant folding is onnxscript's, which also folds the shape arithmetic of a graph whose shapes
are static (Shape of a statically-shaped value, then Gather/Slice/Concat/Unsqueeze/Squeeze/Cast
of constants), so the Reshape/Expand it feeds gets a static output. One addition: onnxscript
keeps every ConstantOfShape (so that folding it does not store a large fill), but torch writes
`expand` over a shape as ConstantOfShape(rank) -> Mul -> Equal -> Where into Expand's shape, and
with that ConstantOfShape kept the Expand, and every shape after it, stays unknown even when the
graph's inputs are static (onnxscript's BART encoder test model: Q "without a static shape").
A ConstantOfShape whose shape is a constant and whose output is a short integer vector is that
shape arithmetic, and is folded; any other stays. A value computed from a graph input whose dim
is symbolic is not a constant, so nothing of a dynamic graph is folded to one sample size.
"""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
from onnxscript import rewriter
from onnxscript.rewriter.rules.common import _no_op

from .base import GraphPass, node_count


MAX_ROUNDS = 8
SHAPE_VECTOR = 16  # the longest ConstantOfShape output folded as shape arithmetic (a shape vector: one dim per axis)
SHAPE_OPS = ("Shape", "Size", "ConstantOfShape")  # counted before and after: shape_ops_removed (folded or merged)
# onnxscript's no-op rules match their constant within a tolerance (x + c for |c| <= 1e-8, x * c for c within 1e-5
# of 1), so they deleted a real epsilon: Helium's RMSNorm adds 1e-8 before its sqrt, and without it a zero row divides
# by zero. Cleanup runs onnxscript's default rules without those (all its no-op rules but the exact Dropout ones).
INEXACT_RULES = tuple(r for r in _no_op.rules if r not in (_no_op.dropout_zero_rule, _no_op.dropout_inference_rule))


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, model: ir.Model) -> bool:
        before = count = node_count(model)
        shape_ops = _shape_ops(model)
        for _ in range(MAX_ROUNDS):  # to a fixed point, so a second cleanup finds nothing left
            with _exact_rules():
                onnxscript.optimizer.optimize_ir(model, num_iterations=2, should_fold=shape_vector)
            ir.passes.common.RemoveUnusedNodesPass()(model)
            if node_count(model) == count:
                break
            count = node_count(model)
        ir.passes.common.RemoveUnusedOpsetsPass()(model)
        ir.passes.common.TopologicalSortPass()(model)
        self.stats["removed"] = before - node_count(model)
        if shape_ops - _shape_ops(model) > 0:
            self.stats["shape_ops_removed"] = shape_ops - _shape_ops(model)
        return False  # GraphPass reports a change when the node count moved


def shape_vector(node: ir.Node) -> bool | None:
    """onnxscript's should_fold: True for a ConstantOfShape of a constant shape that makes a short integer vector
    (shape arithmetic), None (onnxscript's own rules) for every other node."""
    if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    shape = node.inputs[0].const_value if node.inputs[0] is not None else None
    if shape is None:
        return None
    dims = shape.numpy().reshape(-1)
    value = node.attributes.get("value")
    dtype = value.value.dtype if value is not None else ir.DataType.FLOAT  # the op's default fill is float 0
    integer = np.issubdtype(dtype.numpy(), np.integer)
    return True if integer and dims.size == 1 and 0 <= int(dims[0]) <= SHAPE_VECTOR else None


def _shape_ops(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.op_type in SHAPE_OPS and n.domain in ("", "ai.onnx"))


def _at_first_output(rule):
    """`rule` tried only at nodes of its first output's op. onnxscript tries every rule at every node, and for a
    pattern of several outputs (SlicesSplit: two Slices of one tensor) it lists the whole graph at each node it tries:
    O(nodes^2) per round, most of a 30-layer model's export time (SmolLM2-135M: 59%). A match's first output node is
    of that op, so the filtered rule finds the same matches."""
    if rule._target_pattern.has_single_output_node:
        return rule
    first = rule._target_pattern.output_nodes[0].op_identifier()
    if first is None:
        return rule
    filtered = copy.copy(rule)
    whole = rule.try_rewrite
    filtered.try_rewrite = lambda model, graph, node, **kw: (  # noqa: E731
        whole(model, graph, node, **kw) if node.op_identifier() == first else None)
    return filtered


@contextlib.contextmanager
def _exact_rules():
    """optimize_ir reads onnxscript's default rule list when it runs (a private name of the pinned onnxscript)."""
    saved = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(_at_first_output(r) for r in saved if r not in INEXACT_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = saved
