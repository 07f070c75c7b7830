"""block_qdq_weights: a QDQ matmul weight, int8 with a scale per output channel  ==>  int8 with a scale per block of
32 weights along K (llama.cpp's Q8_0 grid, passes/quantize_blocks.py's q8_blocks).

onnxruntime's static quantizer gives each output channel one scale, so a channel's few large weights set the step for
all its others. A trained checkpoint has such channels: SmolLM2-135M, weights alone int8 in eager PyTorch against fp32
over 9 prompts x 64 greedy tokens, measured next-token KL 2.5e-3 per channel, 7.0e-4 in blocks of 32 (6.1e-4 in
blocks of 16, 1.3e-3 in blocks of 64): the logits' rms error at its chat answer's near-tie ('.' 0.30 logits over ',')
fell from 0.36 to 0.19. Per block is DequantizeLinear's blocked form (opset 21: axis 0, block_size 32, scales and zero
points [K/32, N]). QNN's HTP takes it where the matmul's activations are 16-bit (onnxruntime-qnn from 2.4: the HTP
dequantizes the weight per block and multiplies in fp16; for 8-bit weights the block must be a multiple of 4), and so
do OpenVINO and onnxruntime's CPU.

The codes come from the float weights, not from the per-channel codes, which have already lost what the blocks keep:
the float graph's MatMul of the same name (the quantizer keeps node names) gives them.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import const
from .base import GraphPass, NotFused
from .build import Builder
from .quantize_blocks import BLOCK, q8_blocks


class BlockQDQWeights(GraphPass):
    name = "block_qdq_weights"
    min_opset = 21  # DequantizeLinear's block_size

    def __init__(self, floats: ir.Model):
        super().__init__()
        self.floats = {n.name: n.inputs[1] for n in floats.graph if n.op_type == "MatMul" and len(n.inputs) > 1}

    def run(self, model: ir.Model) -> bool:
        for dq in [n for n in model.graph if n.op_type == "DequantizeLinear" and const(n.inputs[0]) is not None
                   and n.inputs[0].dtype == ir.DataType.INT8]:
            try:
                w = self._float_weight(dq)
            except NotFused as e:
                self.note(dq, f"kept per channel: {e}")
                continue
            codes, scales = q8_blocks(w)  # [N, K/32, 32] uint8 (q + 128), [N, K/32]
            k, n = w.shape
            b = Builder(model, dq, f"{self.name}/{dq.name}")
            q = (codes.astype(np.int16) - 128).astype(np.int8).reshape(n, k).T
            dq.replace_input_with(0, b.const(np.ascontiguousarray(q), "codes"))
            scales = np.where(scales > 0, scales, 1).astype(np.float32)  # a block of zeros: codes 0, any scale
            dq.replace_input_with(1, b.const(np.ascontiguousarray(scales.T), "scales"))
            dq.replace_input_with(2, b.const(np.zeros((k // BLOCK, n), np.int8), "zero_points"))
            dq.attributes["axis"] = ir.AttrInt64("axis", 0)
            dq.attributes["block_size"] = ir.AttrInt64("block_size", BLOCK)
            self.stats["blocked"] += 1
        if self.stats["blocked"]:
            ir.passes.common.RemoveUnusedNodesPass()(model)  # the per-channel codes and scales
        return bool(self.stats["blocked"])

    def _float_weight(self, dq: ir.Node) -> np.ndarray:
        """The float weight [K, N] the codes of `dq` stand for; NotFused if there is none that blocks can hold."""
        uses = dq.outputs[0].uses()
        if not uses or any(u.node.op_type != "MatMul" or u.idx != 1 for u in uses):
            raise NotFused("not read as a MatMul weight alone")
        weights = [const(self.floats.get(u.node.name)) for u in uses]
        if any(w is None for w in weights) or any(not np.array_equal(w, weights[0]) for w in weights[1:]):
            raise NotFused(f"no float weight for {', '.join(u.node.name for u in uses)} in the float graph")
        w = weights[0]
        if w.shape != tuple(dq.inputs[0].shape):
            raise NotFused(f"the float graph's weight is {w.shape}, the codes {tuple(dq.inputs[0].shape)}")
        if w.shape[0] % BLOCK:
            raise NotFused(f"K = {w.shape[0]} is not a multiple of {BLOCK}")
        return w.astype(np.float32)
