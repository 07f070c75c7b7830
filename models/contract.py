"""The step contract (DESIGN.md) every exported graph keeps, whatever its target.

    step(hidden_states [B,T,E], position_ids [B,T] int64, past_key/past_value [B,Hkv,C,D])
      -> output [B,T,E], present_key/present_value [B,Hkv,C,D]

The whole language model (`lm`) takes token ids and one cache pair per layer, and returns
the logits of the step's last position:

    lm_step(input_ids [B,T] int64, position_ids [B,T] int64, past_key.i/past_value.i [B,Hkv,C,D])
      -> logits [B,1,V], present_key.i/present_value.i [B,Hkv,C,D]
"""
from __future__ import annotations

import torch

from registry import STEPS

from .config import AttentionConfig

INPUTS = ("hidden_states", "position_ids", "past_key", "past_value")
OUTPUTS = ("output", "present_key", "present_value")


def step_len(config: AttentionConfig, step: str) -> int:
    """T of a step's graph: the prefill chunk, or one token for decode."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}: expected one of {', '.join(STEPS)}")
    return config.chunk if step == "prefill" else 1


def cache_names(config: AttentionConfig, kind: str, prefix: str) -> list[str]:
    """past_key, past_value (a block), or past_key.0, past_value.0, past_key.1, ... (the lm)."""
    if kind != "lm":
        return [f"{prefix}key", f"{prefix}value"]
    return [f"{prefix}{kv}.{i}" for i in range(config.num_layers) for kv in ("key", "value")]


def input_names(config: AttentionConfig, kind: str = "attention") -> tuple:
    first = "input_ids" if kind == "lm" else "hidden_states"
    return (first, "position_ids", *cache_names(config, kind, "past_"))


def output_names(config: AttentionConfig, kind: str = "attention") -> tuple:
    return ("logits" if kind == "lm" else "output", *cache_names(config, kind, "present_"))


def io_specs(config: AttentionConfig, seq_len: int, kind: str = "attention") -> dict:
    """{'inputs': [...], 'outputs': [...]}, each {'name', 'shape', 'dtype'} as numpy names them."""
    float_t = "float16" if config.dtype == "fp16" else "float32"
    b, e, cache = config.batch, config.hidden_size, [config.batch, config.num_kv_heads, config.capacity, config.head_dim]
    spec = lambda name, shape, dtype=float_t: {"name": name, "shape": list(shape), "dtype": dtype}  # noqa: E731
    first = spec("input_ids", (b, seq_len), "int64") if kind == "lm" else spec("hidden_states", (b, seq_len, e))
    out = spec("logits", (b, 1, config.vocab_size)) if kind == "lm" else spec("output", (b, seq_len, e))
    return {
        "inputs": [first, spec("position_ids", (b, seq_len), "int64")]
        + [spec(n, cache) for n in cache_names(config, kind, "past_")],
        "outputs": [out] + [spec(n, cache) for n in cache_names(config, kind, "present_")],
    }


def npu_io_specs(config: AttentionConfig, seq_len: int, kind: str = "attention",
                 masks: tuple[str, ...] = ("attention_mask",)) -> dict:
    """The `npu` step: int32 ids and positions, the host's additive masks over [past C rows, new T rows] (`masks`:
    the plain causal one, and one per sliding window its layers attend within, as the lowered graph reads them),
    every layer's new rows out (key/value, or key.i/value.i)."""
    spec = io_specs(config, seq_len, kind)
    float_t = "float16" if config.dtype == "fp16" else "float32"
    b, kv, c, d = config.batch, config.num_kv_heads, config.capacity, config.head_dim
    inputs = spec["inputs"]
    for s in inputs[:2]:
        if s["dtype"] == "int64":
            s["dtype"] = "int32"
    inputs[2:2] = [{"name": m, "shape": [b, 1, seq_len, c + seq_len], "dtype": float_t} for m in masks]
    spec["outputs"][1:] = [{"name": n, "shape": [b, kv, seq_len, d], "dtype": float_t}
                           for n in cache_names(config, kind, "")]
    return spec


def example_inputs(config: AttentionConfig, seq_len: int, p0: int = 0, seed: int = 0, kind: str = "attention",
                   written: bool = True) -> tuple:
    """Contract inputs in argument order: random hidden states (or token ids) and caches, positions p0..p0+T-1.
    `written=False`: the caches allocated but not written, for a trace, which reads their shapes alone (random rows
    were 470 MB resident through a 0.6B model's trace over 2048 rows)."""
    gen = torch.Generator().manual_seed(seed)
    b, dt = config.batch, config.torch_dtype
    cache = (b, config.num_kv_heads, config.capacity, config.head_dim)
    first = torch.randint(0, config.vocab_size, (b, seq_len), generator=gen) if kind == "lm" else \
        torch.randn(b, seq_len, config.hidden_size, generator=gen).to(dt)
    caches = [torch.randn(cache, generator=gen).to(dt) if written else torch.empty(cache, dtype=dt)
              for _ in cache_names(config, kind, "past_")]
    return (first, (p0 + torch.arange(seq_len)).expand(b, seq_len).contiguous(), *caches)
