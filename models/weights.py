"""Weights for the models: seeded random ones for tests, or MiniMind state dicts from disk.

A MiniMind checkpoint holds every layer under `model.layers.N.`; a block is that prefix,
the attention block is `model.layers.N.self_attn.`, the whole LM takes it all (see
checkpoint.py, which also reads Hugging Face folders). A state dict saved from one of our
modules directly has no prefix at all.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import nn


class WeightsError(ValueError):
    """A weights file that cannot be read or does not fit the model."""


def init_random_(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic weights: projections ~ N(0, 1/fan_in), norm gains ~ 1 + N(0, 0.1).

    Norm gains are perturbed away from 1 so a graph that drops or misplaces a norm
    weight fails parity.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)  # scaled in place: one temporary
            p.copy_(noise.mul_(0.1).add_(1.0) if p.dim() == 1 else noise.div_(math.sqrt(p.shape[1])))
    return model


def checksum(model: nn.Module) -> str:
    """sha256 over the parameters in name order: names the exact weights a graph was built from."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy())  # the array's own buffer: tobytes() copied each (600 MB at 0.6B)
    return "sha256:" + h.hexdigest()


def _read(path: Path) -> dict:
    if path.is_dir():
        raise WeightsError(f"weights file {path}: is a folder; expected a torch state dict (.pt/.pth) "
                           "(a Hugging Face folder loads into the whole model: --kind lm)")
    if not path.is_file():
        raise WeightsError(f"weights file {path}: not found; expected a torch state dict (.pt/.pth)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"weights file {path}: cannot be read as a torch state dict ({first[:160]})") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise WeightsError(f"weights file {path}: expected a dict of tensors (a state dict), got {type(data).__name__}")
    return data


def _select_layer(state: dict, path: Path, layer: int | None, attention_only: bool) -> dict:
    layered = any(k.startswith("model.layers.") for k in state)
    if not layered:
        if layer is not None:
            raise WeightsError(f"weights file {path}: --layer {layer} given, but the file has no 'model.layers.N.' keys")
        return state
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.") and k.split(".")[2].isdigit()})
    if layer is None:
        raise WeightsError(f"weights file {path}: a full checkpoint with layers {layers}; expected --layer N to pick one")
    if layer not in layers:
        raise WeightsError(f"weights file {path}: no layer {layer}; expected one of {layers}")
    prefix = f"model.layers.{layer}." + ("self_attn." if attention_only else "")
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_weights_(model: nn.Module, path: str | Path, layer: int | None = None) -> nn.Module:
    """Copy a MiniMind-format state dict into `model`, or fail naming every key that does not fit."""
    path = Path(path)
    from .attention import Attention
    state = _select_layer(_read(path), path, layer, attention_only=isinstance(model, Attention))
    return fit_(model, state, f"weights file {path}")


def fit_(model: nn.Module, state: dict, source: str) -> nn.Module:
    """Copy `state` into `model`, or fail naming every missing, unexpected and mis-shaped key."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    shape = state.shape if hasattr(state, "shape") else lambda k: tuple(state[k].shape)  # a folder's: from its header
    shapes = sorted(f"{k} {shape(k)} (expected {tuple(expected[k].shape)})"
                    for k in set(expected) & set(state) if shape(k) != tuple(expected[k].shape))
    problems = [f"missing keys {missing}"] * bool(missing) + [f"unexpected keys {extra}"] * bool(extra) \
        + [f"mis-shaped {shapes}"] * bool(shapes)
    if problems:
        raise WeightsError(f"{source}: does not fit the model: {'; '.join(problems)}")
    with torch.no_grad():
        for k, t in expected.items():
            t.copy_(state[k])  # converting as it copies: no converted copy of a 600 MB embedding beside it
    return model
