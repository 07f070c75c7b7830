"""Attention written the other common ways: the forms the fusion passes must recognise.

`VariantAttention` is the decoder step whose every part that people write differently is
a switch: how K is transposed, where the 1/sqrt(D) goes, how the mask is made, how the
softmax keeps fp32, how GQA is computed (K/V heads repeated, or query heads grouped
against the un-repeated K/V), whether the products are einsums, soft-capping, how the
cache is written, or SDPA (exported as an opset-23 Attention) with the repeat in front of it.
`EncoderAttention` is bidirectional self-attention over a key-padding mask, BERT's way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import AttentionConfig
from models.attention import apply_rotary_pos_emb, precompute_freqs_cis, repeat_kv


@dataclass(frozen=True)
class Variant:
    name: str
    scores: str = "transpose"   # transpose | permute | mT
    scale: str = "div"          # div | mul | q | k | q_early (q scaled before its transpose) | none
    mask: str = "masked_fill"   # masked_fill (-inf) | finfo (finfo.min) | additive (course's (1 - m) * -1e9) | triu (no cache)
    softmax: str = "fp32"       # fp32 (.float() ... type_as) | dtype (softmax(dtype=float32)) | plain
    repeat: str = "repeat_kv"   # repeat_kv | repeat_interleave | expand_flatten | tile (h0,h1,h0,h1: not GQA's order)
    write: str = "scatter"      # scatter | index_copy | index_put | offset_put (cache[..., p0 + arange] = k) | none
    sdpa: bool = False          # F.scaled_dot_product_attention after the repeat (opset-23 Attention)
    group: str = "repeat"       # repeat (K/V repeated as `repeat` says) | fold (Q as [B, Hkv, rep*T, D], mask
                                # repeated alike) | grouped (Q as [B, Hkv, rep, T, D] against K/V broadcast)
    einsum: bool = False        # scores and weights @ V written with torch.einsum
    softcap: float = 0.0        # Gemma-2 logit soft-capping, cap * tanh(s / cap), before the mask

    @property
    def cached(self) -> bool:
        return self.write != "none"


class VariantAttention(nn.Module):
    def __init__(self, config: AttentionConfig, variant: Variant):
        super().__init__()
        self.c, self.v = config, variant
        e, h, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj, self.k_proj = nn.Linear(e, h * d, bias=False), nn.Linear(e, hkv * d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(e, hkv * d, bias=False), nn.Linear(h * d, e, bias=False)
        cos, sin = precompute_freqs_cis(d, config.capacity, config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, position_ids=None, past_key=None, past_value=None):
        b, t, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(t).expand(b, t)
        q = self.q_proj(x).view(b, t, self.c.num_heads, -1)
        k = self.k_proj(x).view(b, t, self.c.num_kv_heads, -1)
        v = self.v_proj(x).view(b, t, self.c.num_kv_heads, -1)
        q, k = apply_rotary_pos_emb(q, k, self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype))
        if self.v.scale == "q_early":
            q = q * (1.0 / math.sqrt(q.shape[-1]))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)     # [B, heads, T, D]
        if self.v.cached:
            k, v = self._write(past_key, k, position_ids), self._write(past_value, v, position_ids)
            visible = torch.arange(k.shape[2])[None, None, None, :] <= position_ids[:, None, :, None]
        else:
            visible = ~torch.ones(t, t, dtype=torch.bool).triu(1)
        out = self._attend(q, k, v, visible)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return (out, k, v) if self.v.cached else out

    def _write(self, cache, new, position_ids):
        w, pos = self.v.write, position_ids
        if w == "scatter":
            return cache.scatter(2, pos[:, None, :, None].expand_as(new), new)
        if w == "index_copy":
            return cache.index_copy(2, pos[0], new)
        out = cache.clone()
        rows = pos[0] if w == "index_put" else pos[0, 0] + torch.arange(new.shape[2])
        out[:, :, rows] = new
        return out

    def _repeat(self, x):
        n = self.c.n_rep
        if self.v.repeat == "repeat_kv":
            return repeat_kv(x.transpose(1, 2), n).transpose(1, 2)
        if self.v.repeat == "repeat_interleave":
            return x.repeat_interleave(n, dim=1)
        if self.v.repeat == "tile":
            return x.repeat(1, n, 1, 1)
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, n, s, d).flatten(1, 2)

    def _attend(self, q, k, v, visible):
        """q [B, H, T, D], k/v [B, Hkv, S, D] -> [B, H, T, D]."""
        b, h, t, d = q.shape
        if self.v.group == "repeat":
            k, v = self._repeat(k), self._repeat(v)
        if self.v.sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        s = 1.0 / math.sqrt(d)
        q = q * s if self.v.scale == "q" else q
        k = k * s if self.v.scale == "k" else k
        visible = visible.reshape((1,) * (4 - visible.dim()) + visible.shape)
        n, g = h // k.shape[1], k.shape[1]
        if self.v.group == "fold":  # query heads of a group stacked as rows: [B, Hkv, rep*T, D], mask alike
            q, visible = q.reshape(b, g, n * t, d), visible.repeat(1, 1, n, 1)
        elif self.v.group == "grouped":  # [B, Hkv, rep, T, D] against K/V broadcast over rep
            q, visible = q.reshape(b, g, n, t, d), visible[:, :, None]
        scores = self._scores(q, k)
        if self.v.scale == "div":
            scores = scores / math.sqrt(d)
        elif self.v.scale == "mul":
            scores = scores * s
        if self.v.softcap:
            scores = torch.tanh(scores / self.v.softcap) * self.v.softcap
        if self.v.mask == "masked_fill":
            scores = scores.masked_fill(~visible, float("-inf"))
        elif self.v.mask == "finfo":
            scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        elif self.v.mask == "triu":  # the course's whole-sequence form: a constant -inf upper triangle added
            scores = scores + torch.full(visible.shape[-2:], float("-inf")).triu(1)
        else:  # the course's padding-mask formula, as an additive float mask
            scores = scores + (1.0 - visible.to(scores.dtype)) * -1e9
        if self.v.softmax == "fp32":
            p = F.softmax(scores.float(), dim=-1).type_as(q)
        elif self.v.softmax == "dtype":
            p = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            p = F.softmax(scores, dim=-1)
        return self._weigh(p, v).reshape(b, h, t, d)

    def _scores(self, q, k):
        if self.v.einsum:
            return torch.einsum("bgrtd,bgsd->bgrts" if q.dim() == 5 else "bhtd,bhsd->bhts", q, k)
        k = k[:, :, None] if q.dim() == 5 else k
        last = k.dim() - 1
        kt = {"transpose": lambda: k.transpose(-2, -1), "permute": lambda: k.permute(*range(last - 1), last, last - 1),
              "mT": lambda: k.mT}[self.v.scores]()
        return q @ kt

    def _weigh(self, p, v):
        if self.v.einsum:
            return torch.einsum("bgrts,bgsd->bgrtd" if p.dim() == 5 else "bhts,bhsd->bhtd", p, v)
        return p @ (v[:, :, None] if p.dim() == 5 else v)


class EncoderAttention(nn.Module):
    """Bidirectional self-attention (no RoPE, no cache) over a key-padding mask `keep` [B, S] (1 = a real token),
    masked the way encoders write it: additive (1 - keep) * -10000 (BERT), or a boolean masked_fill; optionally
    causal too (a decoder prefill over a padded batch)."""

    def __init__(self, config: AttentionConfig, padding: str = "additive", causal: bool = False):
        super().__init__()
        self.c, self.padding, self.causal = config, padding, causal
        e, h, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj, self.k_proj = nn.Linear(e, h * d, bias=True), nn.Linear(e, hkv * d, bias=True)
        self.v_proj, self.o_proj = nn.Linear(e, hkv * d, bias=True), nn.Linear(h * d, e, bias=True)

    def forward(self, x, keep):
        b, t, _ = x.shape
        h, hkv, d = self.c.num_heads, self.c.num_kv_heads, self.c.head_dim
        q = self.q_proj(x).view(b, t, h, d).transpose(1, 2)
        k = repeat_kv(self.k_proj(x).view(b, t, hkv, d), h // hkv).transpose(1, 2)
        v = repeat_kv(self.v_proj(x).view(b, t, hkv, d), h // hkv).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if self.padding == "additive":
            scores = scores + (1.0 - keep[:, None, None, :]) * -10000.0
        else:
            scores = scores.masked_fill(keep[:, None, None, :] == 0, float("-inf"))
        if self.causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        p = F.softmax(scores, dim=-1)
        return self.o_proj((p @ v).transpose(1, 2).reshape(b, t, h * d))
