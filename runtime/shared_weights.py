"""One mapping of an export's weights file for every onnxruntime session that reads it.

onnxruntime loads a graph's external weights into each session's own memory: a ladder's driver opens a prefill and a
decode session per window, so a 0.6B model (2.4 GB of fp32 weights) over four windows held eight copies. Sessions
given a SharedWeights read the file through one read-only mapping instead (onnxruntime's shared initializers,
SessionOptions.add_initializer), each tensor once, however many sessions hold it.

The price: onnxruntime then neither pre-packs a float weight (a per-session copy in its GEMM layout) nor folds constant
expressions (a tied lm_head's Transpose runs as its MatMul's transB instead). Products alone hardly show it (24 of
2048 x 2048 ran 32.4 ms a row from the mapping, 31.9 ms pre-packed; a 128-row chunk 5% slower), a whole decode step
does: qwen3-0.6b's ran 95-103 ms unpacked, 79 ms pre-packed. So `share(prepack=True)` keeps pre-packing for the one
session that steps a token at a time (runtime/artifacts.py). The export's graph checks run unpacked (its sequence
check opens the driver as a user does, that copy included: docs/benchmark.md, "Export cost"), and so do the ladders
over more than SHARE_ABOVE bytes of weights. A graph with block-quantized products (MatMulNBits) keeps
pre-packing: unpacked, onnxruntime dequantizes every block at every step (a 2048 x 8192 int4 product measured 115 ms
against 0.8 ms packed, so an int4 export's checks took minutes), and what it packs is the 4-bit codes, about a sixth of
the fp32 bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort


class SharedWeights:
    def __init__(self):
        # (file, offset, dtype, shape) -> the tensor's OrtValue over the mapping; onnxruntime does not keep it alive
        self._values: dict[tuple, ort.OrtValue] = {}

    def __len__(self) -> int:
        return len(self._values)

    def share(self, options: ort.SessionOptions, graph: str | Path, prepack: bool = False) -> int:
        """Give `options` every external initializer of the graph file as a shared one; returns how many. `prepack`:
        let the session pre-pack its float weights all the same, a private copy in the GEMM's layout (a session
        stepping one token at a time ran 1.2x faster from it: a 0.6B decode step 79 ms, 95-103 ms unpacked)."""
        graph = Path(graph)
        model = onnx.load(str(graph), load_external_data=False)
        shared = 0
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            value = self._value(graph.parent, tensor)
            if value is not None:
                options.add_initializer(tensor.name, value)
                shared += 1
        # Each of these would give a session private copies: a pre-packed float weight; a folded Transpose of a shared
        # weight (a tied lm_head: unfolded, onnxruntime fuses it into its MatMul as transB); an arena keeping a step's
        # largest intermediates after the step.
        if not prepack and not any(n.op_type == "MatMulNBits" for n in model.graph.node):
            options.add_session_config_entry("session.disable_prepacking", "1")
        options.add_session_config_entry("optimization.disable_specified_optimizers", "ConstantFolding")
        options.enable_cpu_mem_arena = False
        return shared

    def _value(self, folder: Path, tensor: onnx.TensorProto) -> ort.OrtValue | None:
        info = {e.key: e.value for e in tensor.external_data}
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        except (KeyError, TypeError):  # a type numpy cannot hold (bfloat16, 4-bit): onnxruntime loads it itself
            return None
        if dtype.kind not in "fiub":
            return None
        path, offset, shape = (folder / info["location"]).resolve(), int(info.get("offset", 0)), tuple(tensor.dims)
        key = (str(path), offset, dtype.str, shape)
        if key not in self._values:
            array = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape) if all(shape) else \
                np.zeros(shape, dtype)
            self._values[key] = ort.OrtValue.ortvalue_from_numpy(array)
        return self._values[key]
