"""AttentionConfig: every shape the models and their exported graphs depend on, and the presets.

AttentionConfig: every shape the attention block, the decoder block, the whole language model and
their exported graphs depend on (the LM fields are read by `--kind lm` only).

One dataclass is the single source of truth: the model reads it, the exporter writes it
into the manifest, and the CLI builds one flag per field from the metadata below.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
SOURCES = ("auto", "course", "transformers")


class ConfigError(ValueError):
    """A config field holds a value the model cannot be built with."""


def _f(default, help, flag=None, choices=None):
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


@dataclass(frozen=True)
class AttentionConfig:
    hidden_size: int = _f(768, "model width E", "hidden-size")
    num_heads: int = _f(8, "query heads H", "heads")
    num_kv_heads: int = _f(4, "key/value heads Hkv (H % Hkv == 0; Hkv == H is plain MHA)", "kv-heads")
    head_dim: int = _f(96, "per-head width D (even, for RoPE)", "head-dim")
    rope_theta: float = _f(1e6, "RoPE base frequency", "rope-theta")
    rms_eps: float = _f(1e-6, "RMSNorm epsilon", "rms-eps")
    qk_norm: bool = _f(True, "per-head RMSNorm on Q and K before RoPE", "qk-norm")
    capacity: int = _f(2048, "KV cache capacity C (rows per head)", "capacity")
    chunk: int = _f(128, "prefill chunk length T", "chunk")
    batch: int = _f(1, "batch size B", "batch")
    dtype: str = _f("fp32", "weights and activations dtype", "dtype", tuple(DTYPES))
    sdpa: bool = _f(False, "use F.scaled_dot_product_attention instead of the plain course path", "sdpa")
    intermediate_size: int = _f(0, "SwiGLU width of the decoder block (0: MiniMind's rule, ceil(E*pi/64)*64)", "intermediate-size")
    vocab_size: int = _f(6400, "vocabulary size (lm)", "vocab-size")
    num_layers: int = _f(8, "decoder blocks L (lm)", "layers")
    tie_embeddings: bool = _f(True, "lm_head shares the token embedding's weights (lm)", "tie-embeddings")
    source: str = _f("auto", "what a Hugging Face folder is built as (lm): course (our MiniMind model; MiniMind and "
                     "Qwen3 folders), transformers (the folder's own modeling code, any decoder-only LM), auto (course "
                     "where it fits, else transformers)", "source", SOURCES)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "capacity", "chunk", "batch", "vocab_size",
                     "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name}={value!r}: expected a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"config field num_kv_heads={self.num_kv_heads}: expected a divisor of num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"config field head_dim={self.head_dim}: expected an even number (RoPE rotates pairs)")
        if self.chunk > self.capacity:
            raise ConfigError(f"config field chunk={self.chunk}: expected at most capacity={self.capacity}")
        if not self.rope_theta > 0:
            raise ConfigError(f"config field rope_theta={self.rope_theta}: expected a positive number")
        if not self.rms_eps > 0:
            raise ConfigError(f"config field rms_eps={self.rms_eps}: expected a positive number")
        if self.dtype not in DTYPES:
            raise ConfigError(f"config field dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.source not in SOURCES:
            raise ConfigError(f"config field source={self.source!r}: expected one of {', '.join(SOURCES)}")
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 0:
            raise ConfigError(f"config field intermediate_size={self.intermediate_size!r}: expected 0 or a positive integer")

    @property
    def n_rep(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return 64 * math.ceil(self.hidden_size * math.pi / 64)

    def replace(self, **changes) -> "AttentionConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown config field(s) {sorted(unknown)}: expected one of {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionConfig":
        return cls().replace(**data)


PRESETS = {
    # MiniMind (its MiniMindConfig defaults) at E=768: H=8 query heads sharing Hkv=4 key/value heads,
    # SwiGLU 2432 wide, 8 layers over a 6400-token vocabulary with tied embeddings.
    "minimind": AttentionConfig(),
    # Small enough that a whole export + parity run takes seconds.
    "tiny": AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, capacity=64, chunk=16,
                            vocab_size=128, num_layers=2),
}


def preset(name: str, **overrides) -> AttentionConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)
