"""The MiniMind decoder block: pre-norm attention and a SwiGLU MLP, each with a residual.

    h   = x + self_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))

It keeps the attention block's step interface, so it exports and runs the same way.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .attention import Attention, RMSNorm
from .config import AttentionConfig


class FeedForward(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiniMindBlock(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = FeedForward(config)

    def forward(self, x, position_ids, past_key, past_value):
        attn, present_key, present_value = self.self_attn(self.input_layernorm(x), position_ids, past_key, past_value)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), present_key, present_value

    def forward_cat(self, x, position_ids, past=None):
        attn, present = self.self_attn.forward_cat(self.input_layernorm(x), position_ids, past)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), present

    def forward_full(self, x):
        h = x + self.self_attn.forward_full(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))
