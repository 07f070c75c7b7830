"""fuse_rmsnorm: x * rsqrt(mean(x^2) + eps) * w  ==>  one normalization op.

The pattern (with or without fp32 Casts around it) is onnxscript's, a well-kept rule set;
this pass picks the op: ONNX `RMSNormalization` (opset 23+), or for a target of onnxruntime's
contrib ops `SimplifiedLayerNormalization`, where a residual Add in front of the norm (the
decoder block's) also folds into `SkipSimplifiedLayerNormalization`.
"""
from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter.ort_fusions import rms_normalization as ort_rms
from onnxscript.rewriter.ort_fusions import skip_normalization as ort_skip
from onnxscript.rewriter.rules.fusion import _rms_normalization as onnx_rms

from .base import GraphPass


class FuseRMSNorm(GraphPass):
    name = "fuse_rmsnorm"

    def __init__(self, contrib: bool):
        super().__init__()
        self.contrib = contrib  # onnxruntime's contrib op (com.microsoft) rather than the standard one

    def run(self, model: ir.Model) -> bool:
        if self.contrib:
            self.stats["fused"] = ort_rms.fuse_rms_normalization(model)
            self.stats["skip_fused"] = ort_skip.fuse_skip_rms_normalization(model)
        else:
            self.stats["fused"] = onnx_rms.fuse_rms_normalization(model)
        _annotate_statistics_outputs(model)
        if not self.stats["fused"]:
            self.notes.append({"node": "", "op": "", "reason": "no Pow-ReduceMean-Add-Sqrt-Reciprocal-Mul-Mul "
                                                                   "normalization found"})
        return bool(self.stats["fused"])


def _annotate_statistics_outputs(model: ir.Model) -> None:
    """The skip norm's optional mean / inv_std outputs come without shapes: [..., 1] of the input."""
    for node in model.graph:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            x = node.inputs[0]
            for out in node.outputs[1:3]:
                if out.shape is None:
                    out.shape, out.type = ir.Shape([*x.shape[:-1], 1]), ir.TensorType(ir.DataType.FLOAT)
