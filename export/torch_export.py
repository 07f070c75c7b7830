"""Eager module -> ONNX for one step of the contract, through torch.export and torch.onnx (dynamo)."""
from __future__ import annotations

import contextlib
import io
import logging
import warnings

import onnx_ir as ir
import torch

from models import AttentionConfig
from models.contract import INPUTS, OUTPUTS, example_inputs

DEFAULT_OPSET = 20  # torch.onnx's own default: the primitive ops every runtime reads


def to_onnx(model: torch.nn.Module, config: AttentionConfig, seq_len: int, opset: int = DEFAULT_OPSET) -> ir.Model:
    """Export the step at a fixed T: no dynamic_shapes, so every dim in the graph is a number."""
    args = example_inputs(config, seq_len)
    exported = torch.export.export(model, args, strict=False)
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), _quiet_logs():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(exported, args, dynamo=True, input_names=list(INPUTS),
                                    output_names=list(OUTPUTS), opset_version=opset, verbose=False)
    return program.model


@contextlib.contextmanager
def _quiet_logs():
    """torch.onnx logs registry warnings (e.g. torchvision missing) that say nothing about our graph."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
