"""What a pipeline left unfused, each with the reason the passes gave.

What a pipeline left unfused: attention-shaped subgraphs (a Softmax between two MatMuls)
and repeats still in front of a fused op's K/V, each with the reason the passes gave."""
from __future__ import annotations

import onnx_ir as ir

from .analysis import element_ids, has_duplicates, trace_movement

FUSED_OPS = {("", "Attention"), ("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "MultiHeadAttention")}


def _feeds_matmul(value: ir.Value, depth: int = 4) -> bool:
    frontier = [value]
    for _ in range(depth):
        users = [u for v in frontier for u, _ in v.uses()]
        if any(u.op_type == "MatMul" for u in users):
            return True
        frontier = [o for u in users if u.op_type in ("Cast", "Where", "IsNaN", "Dropout") for o in u.outputs]
    return False


def _fed_by_matmul(value: ir.Value, depth: int = 8) -> bool:
    for _ in range(depth):
        node = value.producer()
        if node is None:
            return False
        if node.op_type == "MatMul":
            return True
        inputs = [v for v in node.inputs if v is not None and v.producer() is not None]
        if not inputs:
            return False
        value = inputs[-1] if node.op_type == "Where" else inputs[0]
    return False


def unfused_attention(model: ir.Model, reports: list[dict],
                      unreported: str = "fuse_attention did not run on this target") -> list[dict]:
    """Each Softmax still between two MatMuls, with the check that stopped fuse_attention on it
    (or `unreported` when the reports say nothing of it)."""
    reasons = {n["node"]: n["reason"] for r in reports if r["pass"] == "fuse_attention" for n in r["not_matched"]}
    left = []
    for node in model.graph:
        if node.op_type == "Softmax" and _fed_by_matmul(node.inputs[0]) and _feeds_matmul(node.outputs[0]):
            left.append({"node": node.name, "op": node.op_type,
                         "reason": reasons.get(node.name, unreported)})
    for node in model.graph:
        if (node.domain, node.op_type) in FUSED_OPS:
            for i in (1, 2):
                if len(node.inputs) > i and node.inputs[i] is not None and len(node.inputs[i].shape or ()) == 4:
                    ids = element_ids(trace_movement(node.inputs[i]))
                    if ids is not None and has_duplicates(ids):
                        left.append({"node": node.name, "op": node.op_type,
                                     "reason": f"input {i} ({node.inputs[i].name}) is still a repeat of its KV heads"})
    return left
