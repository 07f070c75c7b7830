"""pack_qkv: GroupQueryAttention(Split(qkv) -> q, k, v)  ==>  GroupQueryAttention(qkv), key and value absent.

pack_matmuls makes the q/k/v projections one product and splits it; GroupQueryAttention reads that product whole
(its packed-QKV form: query [B, S, (H + 2 Hkv) * D], key and value not given), so the Split and its three copies go.
Only where the three parts are exactly the Split's outputs, in q, k, v order along the last axis with the widths H*D,
Hkv*D, Hkv*D, and nothing else reads them (a q/k norm between the Split and the attention, Qwen3's, keeps it).
"""
from __future__ import annotations

import onnx_ir as ir

from .analysis import const
from .base import GraphPass

MSFT = "com.microsoft"


class PackQKV(GraphPass):
    name = "pack_qkv"

    def run(self, model: ir.Model) -> bool:
        for node in [n for n in model.graph if (n.domain, n.op_type) == (MSFT, "GroupQueryAttention")]:
            if why := self._why_not(node):
                self.note(node, why)
                continue
            split = node.inputs[0].producer()
            node.replace_input_with(0, split.inputs[0])
            node.replace_input_with(1, None)
            node.replace_input_with(2, None)
            model.graph.remove(split, safe=True)
            self.stats["packed"] += 1
        return bool(self.stats["packed"])

    @staticmethod
    def _why_not(node: ir.Node) -> str | None:
        q, k, v = node.inputs[:3]
        split = q.producer() if q is not None else None
        if split is None or split.op_type != "Split" or k is None or v is None:
            return "query, key and value are not the outputs of one Split"
        if list(split.outputs) != [q, k, v]:
            return "the Split's outputs are not query, key and value in that order"
        if any(len(out.uses()) != 1 for out in split.outputs):
            return "a part of the Split is read by another node too"
        axis = split.attributes.get_int("axis", 0)
        rank = len(split.inputs[0].shape or ())
        sizes = const(split.inputs[1]) if len(split.inputs) > 1 else None
        d = node.inputs[3].shape[3] if node.inputs[3] is not None and node.inputs[3].shape else None
        heads, kv = node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")
        if rank != 3 or axis not in (-1, 2):
            return f"the Split is along axis {axis} of a rank-{rank} tensor, not the last of [B, S, width]"
        if sizes is None or d is None or list(sizes) != [heads * d, kv * d, kv * d]:
            return f"the parts' widths {None if sizes is None else list(sizes)} are not H*D, Hkv*D, Hkv*D"
        return None
