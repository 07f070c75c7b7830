"""The MiniMind attention block, written the way the course writes it.

    x -> q/k/v_proj -> view as heads -> q_norm/k_norm -> RoPE(Q, K)
      -> cache write -> repeat_kv -> QK^T / sqrt(D) -> causal mask (-inf)
      -> softmax in fp32 -> weights @ V -> merge heads -> o_proj

Two entry points share every step but the cache and the mask:
- `forward` is the step of the export contract (DESIGN.md): T new tokens at
  `position_ids`, written into a fixed-capacity cache `[B, Hkv, C, D]`, each query
  attending to the cache rows at or before its own absolute position;
- `forward_full` is the course's plain whole-sequence forward, with no cache at all,
  which the cached path is checked against.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import AttentionConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self.weight * self._norm(x.float()).type_as(x)


def precompute_freqs_cis(dim: int, end: int, rope_base: float):
    """cos/sin tables [end, dim], one row per absolute position."""
    freqs = 1.0 / (rope_base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.cat([freqs.cos(), freqs.cos()], dim=-1), torch.cat([freqs.sin(), freqs.sin()], dim=-1)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2):
    """q: [B, T, H, D], k: [B, T, Hkv, D]; cos/sin: [B, T, D], broadcast over heads."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * n_rep, D]: KV head j serves query heads j*n_rep .. j*n_rep+n_rep-1."""
    bs, slen, num_key_value_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, num_key_value_heads, n_rep, head_dim)
            .reshape(bs, slen, num_key_value_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        self.n_local_heads = config.num_heads
        self.n_local_kv_heads = config.num_kv_heads
        self.n_rep = config.n_rep
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        cos, sin = precompute_freqs_cis(config.head_dim, config.capacity, config.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def _project(self, x, position_ids):
        """Q [B, T, H, D] and K, V [B, T, Hkv, D], with norm and RoPE at `position_ids`."""
        bsz, seq_len, _ = x.shape
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        xq = xq.view(bsz, seq_len, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seq_len, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seq_len, self.n_local_kv_heads, self.head_dim)
        xq, xk = self.q_norm(xq), self.k_norm(xk)
        cos, sin = self.freqs_cos[position_ids].to(x.dtype), self.freqs_sin[position_ids].to(x.dtype)
        xq, xk = apply_rotary_pos_emb(xq, xk, cos, sin)
        return xq, xk, xv

    def _attend(self, xq, xk, xv, visible):
        """xq [B, T, H, D], xk/xv [B, S, Hkv, D]; `visible` [.., T, S] is False where a query must not look."""
        bsz, seq_len = xq.shape[:2]
        xq, xk, xv = xq.transpose(1, 2), repeat_kv(xk, self.n_rep).transpose(1, 2), repeat_kv(xv, self.n_rep).transpose(1, 2)
        if self.config.sdpa:
            output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=visible)
        else:
            scores = (xq @ xk.transpose(-2, -1)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~visible, float("-inf"))
            output = F.softmax(scores.float(), dim=-1).type_as(xq) @ xv
        output = output.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.o_proj(output)

    def forward(self, x, position_ids, past_key, past_value):
        """One step over a static cache: returns output [B, T, E] and the updated cache.

        position_ids [B, T] are consecutive absolute positions; rows at those positions of
        past_key/past_value [B, Hkv, C, D] are overwritten, and the query at position p
        sees exactly rows 0..p.
        """
        xq, xk, xv = self._project(x, position_ids)
        index = position_ids[:, None, :, None].expand(-1, self.n_local_kv_heads, -1, self.head_dim)
        present_key = past_key.scatter(2, index, xk.transpose(1, 2))
        present_value = past_value.scatter(2, index, xv.transpose(1, 2))
        rows = torch.arange(past_key.shape[2], device=x.device)
        visible = rows[None, None, None, :] <= position_ids[:, None, :, None]     # [B, 1, T, C]
        output = self._attend(xq, present_key.transpose(1, 2), present_value.transpose(1, 2), visible)
        return output, present_key, present_value

    def forward_cat(self, x, position_ids, past=None):
        """MiniMind's own cached step: earlier K/V ([B, S, Hkv, D] each) concatenated in front of this step's,
        growing by T every step; returns output [B, T, E] and the new (K, V)."""
        xq, xk, xv = self._project(x, position_ids)
        if past is not None:
            xk, xv = torch.cat([past[0], xk], dim=1), torch.cat([past[1], xv], dim=1)
        rows = torch.arange(xk.shape[1], device=x.device)
        visible = rows[None, None, None, :] <= position_ids[:, None, :, None]
        return self._attend(xq, xk, xv, visible), (xk, xv)

    def forward_full(self, x):
        """The course's whole-sequence forward: positions 0..S-1, the future (triu) masked out."""
        bsz, seq_len, _ = x.shape
        position_ids = torch.arange(seq_len, device=x.device).expand(bsz, seq_len)
        xq, xk, xv = self._project(x, position_ids)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
        return self._attend(xq, xk, xv, ~future)
