"""What quantizing a graph's weights needs around the quantizers.

What quantizing a graph's weights needs around the quantizers: weights that are constants (a tied lm_head's
transposed embedding), and onnxruntime's quantization package imported and run quietly (export/quantize.py's QDQ)."""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import onnx_ir as ir

from .analysis import const


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
