"""Eager PyTorch reference models: the truth every exported graph is checked against."""
from __future__ import annotations

import torch

from .attention import Attention
from .block import MiniMindBlock
from .config import PRESETS, AttentionConfig, ConfigError, preset
from .weights import WeightsError, checksum, init_random_, load_weights_

KINDS = {"attention": Attention, "block": MiniMindBlock}


def build_model(config: AttentionConfig, kind: str = "attention", seed: int = 0,
                weights: str | None = None, layer: int | None = None) -> torch.nn.Module:
    """An eval-mode model in the config's dtype: seeded random weights, or loaded from `weights`."""
    if kind not in KINDS:
        raise ConfigError(f"unknown model kind {kind!r}: expected one of {', '.join(KINDS)}")
    model = init_random_(KINDS[kind](config), seed)
    if weights is not None:
        load_weights_(model, weights, layer)
    return model.to(config.torch_dtype).eval()


__all__ = ["Attention", "MiniMindBlock", "AttentionConfig", "ConfigError", "WeightsError", "PRESETS", "KINDS",
           "preset", "build_model", "checksum", "init_random_", "load_weights_"]
