"""Eager PyTorch reference models: the truth every exported graph is checked against."""
from __future__ import annotations

from pathlib import Path

import torch

from .attention import Attention
from .block import MiniMindBlock
from .checkpoint import config_from_folder, load_lm_
from .config import PRESETS, AttentionConfig, ConfigError, preset
from .lm import MiniMindForCausalLM
from .weights import WeightsError, checksum, init_random_, load_weights_

KINDS = {"attention": Attention, "block": MiniMindBlock, "lm": MiniMindForCausalLM}


def build_model(config: AttentionConfig, kind: str = "attention", seed: int = 0,
                weights: str | None = None, layer: int | None = None) -> torch.nn.Module:
    """An eval-mode model in the config's dtype: seeded random weights, or loaded from `weights`; with
    `config.source == "transformers"` (model_config decides it), the folder's own causal LM as the lm step (HFStep)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown model kind {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "lm" and config.source == "transformers":
        if weights is None or not Path(weights).is_dir():
            raise WeightsError(f"source transformers builds a Hugging Face folder's own model; expected --weights "
                               f"FOLDER, got {weights!r}")
        if layer is not None:
            raise WeightsError(f"--layer {layer} picks one block of a checkpoint; the lm takes every layer")
        from .hf_step import load_hf_step
        return load_hf_step(config, weights)
    if weights is not None and kind == "lm":
        if layer is not None:
            raise WeightsError(f"--layer {layer} picks one block of a checkpoint; the lm takes every layer")
        return load_lm_(KINDS[kind](config), weights).to(config.torch_dtype).eval()  # every weight: none left random
    model = init_random_(KINDS[kind](config), seed)
    if weights is not None:
        load_weights_(model, weights, layer)
    return model.to(config.torch_dtype).eval()


def model_config(config: AttentionConfig, kind: str, weights: str | None) -> AttentionConfig:
    """The config a model is built with: a Hugging Face folder's config.json gives the lm its dims and its source
    (the course model, or the folder's own transformers modeling code)."""
    if kind == "lm" and weights is not None and Path(weights).is_dir():
        return config_from_folder(weights, config)
    return config


__all__ = ["Attention", "MiniMindBlock", "MiniMindForCausalLM", "AttentionConfig", "ConfigError", "WeightsError",
           "PRESETS", "KINDS", "preset", "build_model", "model_config", "checksum", "init_random_", "load_weights_"]
