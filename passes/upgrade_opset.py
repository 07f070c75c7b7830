"""upgrade_opset: convert the graph to the target's ONNX opset (24 has Attention, TensorScatter,
RotaryEmbedding and RMSNormalization)."""
from __future__ import annotations

import onnx_ir as ir
import onnxscript.version_converter

from .base import GraphPass


class UpgradeOpset(GraphPass):
    name = "upgrade_opset"

    def __init__(self, version: int):
        super().__init__()
        self.version = version

    def run(self, model: ir.Model) -> bool:
        current = model.opset_imports.get("", 0)
        if current >= self.version:
            return False
        onnxscript.version_converter.convert_version(model, self.version)
        model.opset_imports[""] = self.version
        self.stats[f"opset {current} -> {self.version}"] = 1
        return True
