"""The step contract (DESIGN.md) every exported graph keeps, whatever its target.

    step(hidden_states [B,T,E], position_ids [B,T] int64, past_key/past_value [B,Hkv,C,D])
      -> output [B,T,E], present_key/present_value [B,Hkv,C,D]
"""
from __future__ import annotations

import torch

from .config import AttentionConfig

INPUTS = ("hidden_states", "position_ids", "past_key", "past_value")
OUTPUTS = ("output", "present_key", "present_value")
STEPS = ("prefill", "decode")


def step_len(config: AttentionConfig, step: str) -> int:
    """T of a step's graph: the prefill chunk, or one token for decode."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}: expected one of {', '.join(STEPS)}")
    return config.chunk if step == "prefill" else 1


def io_specs(config: AttentionConfig, seq_len: int) -> dict:
    """{'inputs': [...], 'outputs': [...]}, each {'name', 'shape', 'dtype'} as numpy names them."""
    float_t = "float16" if config.dtype == "fp16" else "float32"
    b, e, cache = config.batch, config.hidden_size, [config.batch, config.num_kv_heads, config.capacity, config.head_dim]
    spec = lambda name, shape, dtype=float_t: {"name": name, "shape": list(shape), "dtype": dtype}  # noqa: E731
    return {
        "inputs": [spec("hidden_states", (b, seq_len, e)), spec("position_ids", (b, seq_len), "int64"),
                   spec("past_key", cache), spec("past_value", cache)],
        "outputs": [spec("output", (b, seq_len, e)), spec("present_key", cache), spec("present_value", cache)],
    }


def npu_io_specs(config: AttentionConfig, seq_len: int) -> dict:
    """The `npu` step: int32 positions, the host's additive mask over [past C rows, new T rows], new rows out."""
    spec = io_specs(config, seq_len)
    float_t = spec["inputs"][0]["dtype"]
    b, kv, c, d = config.batch, config.num_kv_heads, config.capacity, config.head_dim
    inputs = spec["inputs"]
    inputs[1]["dtype"] = "int32"
    inputs.insert(2, {"name": "attention_mask", "shape": [b, 1, seq_len, c + seq_len], "dtype": float_t})
    spec["outputs"][1:] = [{"name": n, "shape": [b, kv, seq_len, d], "dtype": float_t} for n in ("key", "value")]
    return spec


def example_inputs(config: AttentionConfig, seq_len: int, p0: int = 0, seed: int = 0) -> tuple:
    """Contract inputs in argument order: random hidden states and cache, positions p0..p0+T-1."""
    gen = torch.Generator().manual_seed(seed)
    b, dt = config.batch, config.torch_dtype
    cache = (b, config.num_kv_heads, config.capacity, config.head_dim)
    return (torch.randn(b, seq_len, config.hidden_size, generator=gen).to(dt),
            (p0 + torch.arange(seq_len)).expand(b, seq_len).contiguous(),
            torch.randn(cache, generator=gen).to(dt),
            torch.randn(cache, generator=gen).to(dt))
