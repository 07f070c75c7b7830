"""pack_matmuls: MatMuls that read the same activation with constant weights  ==>  one MatMul + Split.

q/k/v projections (and the block's gate/up) become one wider product: one pass over the
activation and one kernel instead of three, which a decode step, bound by reading the
weights, spends on launch and synchronisation rather than on arithmetic.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import const, static_shape
from .base import GraphPass
from .build import Builder, replace_value


class PackMatMuls(GraphPass):
    name = "pack_matmuls"

    def run(self, model: ir.Model) -> bool:
        groups: dict[int, list[ir.Node]] = {}
        for node in model.graph:
            w = const(node.inputs[1]) if node.op_type == "MatMul" and node.domain == "" else None
            if w is not None and w.ndim == 2 and static_shape(node.outputs[0]) is not None:
                groups.setdefault(id(node.inputs[0]), []).append(node)
        for nodes in (g for g in groups.values() if len(g) > 1):
            weights = [const(n.inputs[1]) for n in nodes]
            if len({w.dtype for w in weights}) != 1:
                continue
            x = nodes[0].inputs[0]
            b = Builder(model, nodes[0], f"{self.name}/{nodes[0].name}")
            sizes = [w.shape[1] for w in weights]
            lead = list(static_shape(nodes[0].outputs[0])[:-1])
            tensors = [n.inputs[1].const_value for n in nodes]
            weight = b.initializer(_concatenation(tensors), "packed_weight")
            packed = b.op("MatMul", [x, weight], lead + [sum(sizes)], nodes[0].outputs[0].dtype)
            parts = b.op("Split", [packed, b.const(np.array(sizes, np.int64), "sizes")], None, None,
                         num_outputs=len(nodes), shapes=[lead + [s] for s in sizes],
                         dtypes=[packed.dtype] * len(nodes), axis=-1)
            for node, part in zip(nodes, parts):
                replace_value(node.outputs[0], part)
            self.stats["packed"] += len(nodes)
        if self.stats["packed"]:
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return bool(self.stats["packed"])


def _concatenation(parts: list[ir.TensorProtocol]) -> ir.LazyTensor:
    """The 2-D parts side by side, computed each time it is read rather than held: a whole model's q/k/v and gate/up
    are most of its weights, and an export writes this to its weights file once, then drops it."""
    shape = ir.Shape([parts[0].shape[0], sum(p.shape[1] for p in parts)])
    return ir.LazyTensor(lambda: ir.tensor(np.concatenate([p.numpy() for p in parts], axis=1)), dtype=parts[0].dtype,
                         shape=shape)
