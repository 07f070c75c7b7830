"""The workloads, and what each must at least cost: bytes for decode, FLOPs for prefill."""
from __future__ import annotations

from dataclasses import dataclass

from models import AttentionConfig

KINDS = ("attention", "block")


@dataclass(frozen=True)
class Workload:
    kind: str      # attention | block
    step: str      # prefill | decode
    p0: int        # first position written: the cache holds rows 0..p0-1 before the step

    @property
    def name(self) -> str:
        return ("block/" if self.kind == "block" else "") + f"{self.step}@{self.p0}"

    def seq_len(self, c: AttentionConfig) -> int:
        return c.chunk if self.step == "prefill" else 1

    def weight_bytes(self, c: AttentionConfig) -> int:
        e, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        params = 2 * e * qd + 2 * e * kvd + (2 * c.head_dim if c.qk_norm else 0)
        if self.kind == "block":
            params += 3 * e * c.ffn_size + 2 * e
        return params * _elem(c)

    def cache_bytes(self, c: AttentionConfig) -> int:
        """K and V rows a step must read: the live part of the cache, up to and including its own rows."""
        return 2 * c.batch * c.num_kv_heads * (self.p0 + self.seq_len(c)) * c.head_dim * _elem(c)

    def working_set(self, c: AttentionConfig) -> int:
        return self.weight_bytes(c) + self.cache_bytes(c)

    def flops(self, c: AttentionConfig) -> int:
        t, e, d = c.batch * self.seq_len(c), c.hidden_size, c.head_dim
        proj = 2 * t * e * (2 * c.num_heads * d + 2 * c.num_kv_heads * d)
        attn = 2 * 2 * t * (self.p0 + self.seq_len(c)) * c.num_heads * d  # QK^T and PV over live rows
        mlp = 2 * t * e * c.ffn_size * 3 if self.kind == "block" else 0
        return proj + attn + mlp


def _elem(c: AttentionConfig) -> int:
    return 2 if c.dtype == "fp16" else 4


def workloads(config: AttentionConfig, quick: bool) -> list[Workload]:
    c, t = config, config.chunk
    if quick:
        return [Workload("attention", "decode", min(1024, c.capacity - 1)), Workload("attention", "prefill", 0)]
    points = [("prefill", 0), ("prefill", min(1024, c.capacity - t)), ("decode", min(128, c.capacity - 1)),
              ("decode", min(1024, c.capacity - 1)), ("decode", c.capacity - 1)]
    return [Workload(kind, step, p0) for kind in KINDS for step, p0 in points]
