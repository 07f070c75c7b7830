"""Eager module -> ONNX through torch.export (strict=False) and torch.onnx.export(dynamo=True), at static shapes."""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import warnings

import onnx_ir as ir
import torch

from models import AttentionConfig
from models.contract import example_inputs, input_names, output_names

DEFAULT_OPSET = 20  # torch.onnx's own default: the primitive ops every runtime reads


def to_onnx(model: torch.nn.Module, config: AttentionConfig, seq_len: int, opset: int = DEFAULT_OPSET,
            kind: str = "attention", any_window: bool = False) -> ir.Model:
    """The step of the contract at a fixed T, over config.capacity cache rows; with `any_window`, over a symbolic
    number of rows (cache_rows() names it), pinned per window by the passes' fix_dims: one trace serves a whole
    window ladder (a 30-layer model's trace is half a minute)."""
    args = example_inputs(config, seq_len, kind=kind, written=False)
    dynamic = _cache_rows(model, len(args)) if any_window else None
    return export_module(model, args, input_names(config, kind), output_names(config, kind), opset, dynamic)


def cache_rows(model: ir.Model) -> str | None:
    """The name of the cache's row axis in a graph from to_onnx(any_window=True), or None where it is a number."""
    dim = next(v.shape[2] for v in model.graph.inputs if v.name.startswith("past_"))
    return None if isinstance(dim, int) else str(dim)


def _cache_rows(module: torch.nn.Module, n_args: int) -> tuple:
    """torch.export's dynamic_shapes: every cache's row axis (dim 2) one symbol; the step's first two inputs static.
    A step taking its caches as *past (the whole model) gets them as one nested tuple, as torch.export wants."""
    rows = torch.export.Dim("cache_rows", min=2, max=1 << 20)
    caches = [{2: rows} for _ in range(n_args - 2)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(module.forward).parameters.values())
    return (None, None, tuple(caches)) if variadic else (None, None, *caches)


def export_module(module: torch.nn.Module, args: tuple, input_names, output_names, opset: int = DEFAULT_OPSET,
                  dynamic_shapes=None) -> ir.Model:
    """Every dim in the graph a number, but those `dynamic_shapes` (torch.export's) makes symbols."""
    _reuse_torchlib_registry()
    exported = torch.export.export(module, tuple(args), dynamic_shapes=dynamic_shapes, strict=False)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet_logs():
        warnings.simplefilter("ignore")
        # optimize=False: onnxscript's optimizer (on by default) folds Add(x, 1e-8) away as adding zero (its add_0
        # rule), so an RMSNorm with eps 1e-8 (helium) divides by zero; the passes' cleanup folds constants anyway.
        program = torch.onnx.export(exported, tuple(args), dynamo=True, input_names=list(input_names),
                                    output_names=list(output_names), opset_version=opset, verbose=False,
                                    optimize=False)
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


@functools.cache
def _reuse_torchlib_registry() -> None:
    """torch.onnx builds its registry of ONNX decompositions anew for every export (about 1 s of a
    2.5 s export here); nothing changes it between exports, so build it once per opset per process.
    Private API of the pinned torch; if it moves, exports just stay as slow as before."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        return
    build = getattr(_registration.ONNXRegistry, "from_torchlib", None)
    if build is None:
        return
    built = {}

    def from_torchlib(cls, opset_version=None):
        if opset_version not in built:
            built[opset_version] = build() if opset_version is None else build(opset_version=opset_version)
        return built[opset_version]
    _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)
