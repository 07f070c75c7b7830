"""Export one model to its prefill and decode graphs plus manifest.json, checked before publishing.

Each graph is exported, saved into a staging folder, verified (onnx.checker, static
shapes, parity against eager PyTorch), and only then moved into the output folder, with
the manifest last: a manifest on disk means its graphs passed.
"""
from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from models import AttentionConfig, build_model, checksum
from models.contract import STEPS, io_specs, step_len
from runtime.generate import Generator
from runtime.parity import TOLERANCE, sequence_parity, step_parity, within, worst
from runtime.session import StepSession

from .atomic import publish, staging, write_json
from .manifest import build_manifest
from .static_shapes import check_static
from .torch_export import DEFAULT_OPSET, to_onnx

EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a file at 2 GiB; stay well clear of it
TARGET = "raw"


class ParityError(AssertionError):
    """An exported graph computes something other than the eager model."""


def save_onnx(model: ir.Model, path: Path) -> str | None:
    """Save; weights go to `<file>.data` beside it when they would push the file near 2 GiB."""
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    data = f"{path.name}.data" if weight_bytes > EXTERNAL_DATA_BYTES else None
    ir.save(model, path, external_data=data)
    return data


def parity_cases(config: AttentionConfig, step: str) -> list[int]:
    """Start positions that exercise an empty cache and the last rows of a full one."""
    t = step_len(config, step)
    return sorted({0, (config.capacity - t) // 2, config.capacity - t})


def export_model(config: AttentionConfig, out_dir: str | Path, kind: str = "attention", seed: int = 0,
                 weights: str | None = None, layer: int | None = None, opset: int = DEFAULT_OPSET,
                 name: str | None = None, log=print) -> dict:
    out_dir = Path(out_dir)
    model = build_model(config, kind, seed, weights, layer)
    graphs, files = [], []
    with staging(out_dir) as tmp:
        for step in STEPS:
            t = step_len(config, step)
            path = tmp / f"{step}.onnx"
            data = save_onnx(to_onnx(model, config, t, opset), path)
            onnx.checker.check_model(str(path), full_check=True)
            check_static(path)
            session = StepSession(path, provider="cpu")
            cases = [step_parity(model, session, config, t, p0, seed) for p0 in parity_cases(config, step)]
            err = worst(cases)
            if not within(err, config.dtype):
                raise ParityError(f"{step}.onnx: max error {err} against eager PyTorch; expected within {TOLERANCE[config.dtype]}")
            files += [path.name] + ([data] if data else [])
            graphs.append({"step": step, "target": TARGET, "file": path.name, "external_data": data,
                           "bytes": path.stat().st_size + ((tmp / data).stat().st_size if data else 0),
                           **io_specs(config, t),
                           "parity": {"reference": "eager PyTorch, fp32", "tolerance": TOLERANCE[config.dtype], **err,
                                      "cases": [{k: c[k] for k in ("p0", "max_abs", "max_rel")} for c in cases]}})
        sessions = {g["step"]: StepSession(tmp / g["file"], g["inputs"], g["outputs"], provider="cpu") for g in graphs}
        seq = sequence_parity(model, Generator(sessions["prefill"], sessions["decode"]), config,
                              prompt_len=min(config.capacity - 16, config.chunk + config.chunk // 2 + 1), decode_steps=16, seed=seed)
        if not within(seq, config.dtype):
            raise ParityError(f"sequence parity: max error {seq} against the eager full-sequence forward")
        manifest = build_manifest(config, kind, name or out_dir.name, opset, graphs, seq,
                                  {"source": weights or f"random(seed={seed})", "layer": layer, "checksum": checksum(model)})
        write_json(tmp / "manifest.json", manifest)
        publish(tmp, out_dir, files + ["manifest.json"])
    for g in graphs:
        shapes = ", ".join(f"{s['name']}{s['shape']}" for s in g["inputs"][:2])
        log(f"wrote {out_dir / g['file']} ({g['bytes'] / 1e6:.1f} MB, target {g['target']}): {shapes}; "
            f"parity vs eager max abs {g['parity']['max_abs']:.2e} over p0={[c['p0'] for c in g['parity']['cases']]}")
    log(f"wrote {out_dir / 'manifest.json'}: sequence parity (prefill {seq['prompt_len']} + {seq['decode_steps']} decode steps) "
        f"max abs {seq['max_abs']:.2e}; cache {graphs[0]['inputs'][2]['shape']} {graphs[0]['inputs'][2]['dtype']}")
    return manifest
