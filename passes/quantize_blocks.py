"""quantize_blocks: MatMul by a constant weight  ==>  com.microsoft.MatMulNBits over blocks of 32 weights.

Weight-only quantization (activations stay fp32, the attention ops around the products as the earlier passes made
them): a decode step reads every weight once per token, so fewer bits are what make it faster. Accuracy level 4 lets
the kernel compute in int8 (the activations quantized per block on the fly), which on this CPU is what makes
MatMulNBits fast (docs/quantization.md).

int8 (bits=8): every block symmetric, w = scale * q with |q| <= 127 (llama.cpp's Q8_0).

int4 (bits=4), quantized here rather than by onnxruntime's symmetric quantizer: every block of 32 weights along K
keeps a scale d and a minimum m, w = m + d * q with q in 0..15 (llama.cpp's Q4_1 grid), so a block spans exactly its
own range. A checkpoint already stored that way (SmolLM2's GGUF) is held exactly; onnxruntime's symmetric int4
re-rounds it onto a grid through zero and measured KL 0.35 nats against fp32 on SmolLM2-135M's decode step, this
0.005 (the rest is level 4's int8 activations; at level 0 the step is within 1.4e-6 of fp32).

MatMulNBits has no fast kernel for a float zero point (measured 40x slower on this CPU), so the weights are coded as
its default symmetric form, d * (q - 8), and the rest of each weight, c = m + 8d, is one number per block: its share
of the product is each block's input sum times c, a [.., K/32] x [K/32, N] product added to the output (as the
kernel's bias input where the product has one row, the decode step of batch 1: one op fewer).

Under int4 the output projection (the lm_head: the last MatMul before the graph's first output) gets the int8 blocks
(Q8_0, which is how GGUF checkpoints store the tied embedding it reads): every logit comes out of it, and at 4 bits
it measured 12x the KL of the rest of the model on SmolLM2.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .analysis import const, static_shape
from .base import GraphPass
from .build import Builder, replace_value
from .quantize_weights import constant_weights

BLOCK = 32
COLUMN_ELEMENTS = 1 << 23  # weights quantized at once: 64 MB of float64 per temporary
HEAD_BITS = 8
MSFT = "com.microsoft"


def q4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [K, N] (K a multiple of BLOCK) -> (codes [N, K/32, 16] uint8, two per byte, the even element in the low nibble;
    scales d [N, K/32]; per-block rest c [K/32, N]) with W = d * (q - 8) + c, per block exactly m + d * q."""
    codes, d, rest = _by_columns(w, _q4_columns, 3)
    return codes, d, rest.T


def q8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] -> (codes [N, K/32, 32] uint8, q + 128; scales [N, K/32]) with W = scale * (code - 128), |q| <= 127."""
    return _by_columns(w, _q8_columns, 2)


def _by_columns(w: np.ndarray, quantize, parts: int) -> tuple:
    """`quantize` over W's columns a slice at a time, its parts concatenated along N. A block never spans two columns,
    so this is exact; it bounds the float64 temporaries (an lm_head of 151936 x 1024 was 1.2 GB each, five at once)."""
    k, n = w.shape
    step = max(1, COLUMN_ELEMENTS // k)
    pieces = [quantize(w[:, j:j + step]) for j in range(0, n, step)]
    return tuple(np.concatenate([p[i] for p in pieces]) for i in range(parts))


def rounded(w: np.ndarray, bits: int) -> np.ndarray:
    """W [K, N] as its blocks decode (int4: Q4_1, int8: Q8_0): the weights a quantized product multiplies by, for
    what the grid alone costs a model (export/grid_cost.py)."""
    blocks = _blocks(w)
    q, scale, low = _q4(blocks) if bits == 4 else (*_q8(blocks), 0.0)
    n, k = w.shape[1], w.shape[0]
    return (low + scale * q).reshape(n, k).T.astype(w.dtype)


def _q4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks [..., 32] -> (q in 0..15, d, m), each block = m + d * q."""
    low, high = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
    d = (high - low) / 15
    return np.clip(np.round((blocks - low) / np.where(d == 0, 1, d)), 0, 15), d, low


def _q8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [..., 32] -> (q in -127..127, scale), each block = scale * q."""
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    return np.clip(np.round(blocks / np.where(scale == 0, 1, scale)), -127, 127), scale


def _q4_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q, d, low = _q4(_blocks(w))
    d, low = d[..., 0], low[..., 0]
    return _pack4(q.astype(np.uint8)), d.astype(w.dtype), (low + 8 * d).astype(w.dtype)


def _q8_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, scale = _q8(_blocks(w))
    return (q + 128).astype(np.uint8), scale[..., 0].astype(w.dtype)


def _blocks(w: np.ndarray) -> np.ndarray:
    k, n = w.shape
    return w.T.reshape(n, k // BLOCK, BLOCK).astype(np.float64)


def _pack4(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def output_projection(model: ir.Model) -> ir.Node | None:
    """The MatMul the graph's first output comes out of (the lm_head), through the elementwise and shape ops after it
    (a soft-cap, a slice of the last position, a reshape); None if there is none."""
    value = model.graph.outputs[0] if model.graph.outputs else None
    for _ in range(8):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type == "MatMul" and node.domain == "":
            return node
        value = node.inputs[0] if node.inputs else None
    return None


class QuantizeBlocks(GraphPass):
    name = "quantize_blocks"

    def __init__(self, bits: int, accuracy_level: int):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits={bits}; expected 4 (a scale and a minimum per block, the lm_head int8) or 8")
        self.bits, self.accuracy_level = bits, accuracy_level

    def run(self, model: ir.Model) -> bool:
        self.stats["weights_untransposed"] = constant_weights(model)
        head = output_projection(model)
        for node in [n for n in model.graph if n.op_type == "MatMul" and n.domain == ""]:
            w, rows = const(node.inputs[1]), static_shape(node.inputs[0])
            if w is None or w.ndim != 2 or w.dtype.kind != "f":
                self.note(node, "weight is not a constant float matrix")
            elif w.shape[0] % BLOCK or rows is None:
                self.note(node, f"K = {w.shape[0]} is not a multiple of {BLOCK}" if rows is not None
                          else "its input has no static shape")
            elif node is head or self.bits == 8:
                self._int8(model, node, w)
                self.stats["head_int8" if node is head else "quantized"] += 1
            else:
                self._int4(model, node, w, int(np.prod(rows[:-1])))
                self.stats["quantized"] += 1
        if self.stats["quantized"] or self.stats["head_int8"]:
            model.opset_imports.setdefault(MSFT, 1)
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return bool(self.stats["quantized"] or self.stats["head_int8"])

    def _nbits(self, b: Builder, x: ir.Value, codes, scales, k: int, n: int, bits: int, bias=None) -> ir.Value:
        shape = list(x.shape)[:-1] + [n]
        inputs = [x, b.const(codes, "codes"), b.const(scales, "scales")] + ([None, None, bias] if bias else [])
        return b.op("MatMulNBits", inputs, shape, x.dtype, domain=MSFT, K=k, N=n, bits=bits, block_size=BLOCK,
                    accuracy_level=self.accuracy_level)

    def _int8(self, model: ir.Model, node: ir.Node, w: np.ndarray) -> None:
        b = Builder(model, node, f"{self.name}/{node.name}")
        codes, scales = q8_blocks(w)
        replace_value(node.outputs[0], self._nbits(b, node.inputs[0], codes, scales, *w.shape, HEAD_BITS))

    def _int4(self, model: ir.Model, node: ir.Node, w: np.ndarray, rows: int) -> None:
        """MatMulNBits of the codes, plus each block's input sum times its rest c (the bias input for one row)."""
        b = Builder(model, node, f"{self.name}/{node.name}")
        (k, n), x = w.shape, node.inputs[0]
        codes, scales, rest = q4_blocks(w)
        lead = list(x.shape)[:-1] if rows > 1 else []
        blocks = b.op("Reshape", [x, b.const(np.array(lead + [k // BLOCK, BLOCK], np.int64), "blocks")],
                      lead + [k // BLOCK, BLOCK], x.dtype)
        sums = b.op("ReduceSum", [blocks, b.const(np.array([-1], np.int64), "axis")], lead + [k // BLOCK], x.dtype,
                    keepdims=0)
        share = b.op("MatMul", [sums, b.const(rest, "rest")], lead + [n], x.dtype)
        if rows == 1:
            out = self._nbits(b, x, codes, scales, k, n, 4, bias=share)
        else:
            out = b.op("Add", [self._nbits(b, x, codes, scales, k, n, 4), share], list(x.shape)[:-1] + [n], x.dtype)
        replace_value(node.outputs[0], out)
