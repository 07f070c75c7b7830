"""quantize_weights: MatMul by a constant weight  ==>  com.microsoft.MatMulNBits over int4 or int8 blocks.

Weight-only quantization, done by onnxruntime's own quantizer (MatMulNBitsQuantizer,
symmetric, one fp32 scale per `block_size` weights along K); activations stay fp32 and the
attention ops around the products are left as the earlier passes made them. A decode step
reads every weight once per token, so this is what makes it faster: 4 bits move an eighth of
the bytes. `accuracy_level` 4 lets the kernel compute in int8 (the activations quantized per
block on the fly), which on this CPU is what makes MatMulNBits fast (docs/quantization.md).
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import onnx_ir as ir

from .analysis import const
from .base import GraphPass


def ort_quantization():
    """onnxruntime.quantization, imported without the INFO-level root logger its modules set up (logging.basicConfig
    on import), which would print every later library's info messages."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    import onnxruntime.quantization
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401
    root.setLevel(level)
    root.handlers[:] = handlers
    return onnxruntime.quantization


@contextlib.contextmanager
def quiet():
    """onnxruntime's quantizers log every node and tensor at INFO/WARNING; keep their errors only."""
    logger = logging.getLogger("onnxruntime.quantization")
    root = logging.getLogger()
    saved = logger.level, root.level
    logger.setLevel(logging.ERROR)
    root.setLevel(max(root.level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        root.setLevel(saved[1])


def constant_weights(model: ir.Model) -> int:
    """Give every MatMul whose weight is a Transpose of a stored matrix (a tied lm_head reads the embedding that way;
    the optimizer does not fold tensors that large) that transpose as its own initializer, so a quantizer sees a
    constant weight. Returns how many it gave one."""
    done = 0
    for node in [n for n in model.graph if n.op_type == "MatMul" and n.domain == ""]:
        producer = node.inputs[1].producer()
        if producer is None or producer.op_type != "Transpose" or (source := const(producer.inputs[0])) is None \
                or source.ndim != 2:
            continue
        perm = producer.attributes.get_ints("perm", [1, 0])
        if list(perm) != [1, 0]:
            continue
        name = f"{producer.inputs[0].name}/transposed"
        value = model.graph.initializers.get(name)
        if value is None:
            value = ir.Value(name=name, shape=ir.Shape(source.shape[::-1]), type=ir.TensorType(producer.inputs[0].dtype),
                             const_value=ir.tensor(np.ascontiguousarray(source.T), name=name))
            model.graph.register_initializer(value)
        node.replace_input_with(1, value)
        done += 1
    return done


class QuantizeWeights(GraphPass):
    name = "quantize_weights"

    def __init__(self, bits: int, block_size: int, accuracy_level: int):
        super().__init__()
        self.bits, self.block_size, self.accuracy_level = bits, block_size, accuracy_level

    def run(self, model: ir.Model) -> bool:
        MatMulNBitsQuantizer = ort_quantization().matmul_nbits_quantizer.MatMulNBitsQuantizer
        self.stats["weights_untransposed"] = constant_weights(model)
        candidates = [n for n in model.graph if n.op_type == "MatMul" and n.domain == ""]
        for node in candidates:
            w = const(node.inputs[1])
            if w is None or w.ndim != 2:
                self.note(node, "weight is not a constant matrix" if w is None else f"weight has rank {w.ndim}, not 2")
            elif w.dtype.kind != "f":
                self.note(node, f"weight is {w.dtype}, not float")
        if len(self.notes) == len(candidates):
            self.stats["quantized"] = 0
            return False
        quantizer = MatMulNBitsQuantizer(ir.serde.serialize_model(model), bits=self.bits, block_size=self.block_size,
                                         is_symmetric=True, accuracy_level=self.accuracy_level)
        with quiet():
            quantizer.process()
        done = ir.serde.deserialize_model(quantizer.model.model)
        model.graph = done.graph
        model.opset_imports.update(done.opset_imports)
        self.stats["quantized"] = sum(n.op_type == "MatMulNBits" for n in done.graph)
        for node in (n for n in done.graph if n.op_type == "MatMul" and n.domain == "" and const(n.inputs[1]) is not None):
            self.note(node, "left in float by onnxruntime's quantizer")
        return self.stats["quantized"] > 0
