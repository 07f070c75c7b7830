"""upgrade_opset: convert the graph to the target's ONNX opset (24 has Attention, TensorScatter,
RotaryEmbedding and RMSNormalization).

onnxscript's converter covers opsets 18 and up; older graphs (TorchScript-era exports at
opset 11-17, whose reductions still take axes as an attribute) go through onnx's own
converter, with the weights held aside.
"""
from __future__ import annotations

import logging

import onnx_ir as ir
from onnxscript.version_converter import ConvertVersionPass

from .base import GraphPass, NotFused


class UpgradeOpset(GraphPass):
    name = "upgrade_opset"

    def __init__(self, version: int):
        super().__init__()
        self.version = version

    def run(self, model: ir.Model) -> bool:
        current = model.opset_imports.get("", 0)
        if current >= self.version:
            return False
        logging.getLogger("onnxscript.version_converter").setLevel(logging.ERROR)
        ConvertVersionPass(self.version, fallback=True)(model)
        if model.opset_imports.get("") != self.version:
            raise NotFused(f"the onnx version converter cannot convert this graph from opset {current} to {self.version}")
        self.stats[f"opset {current} -> {self.version}"] = 1
        return True
