"""Eager attention modules as Hugging Face transformers writes them (random weights, no downloads),
wrapped to run a prefill over T tokens with an explicit additive causal mask."""
from __future__ import annotations

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def _classes(family: str):
    if family == "llama":
        from transformers.models.llama import modeling_llama as m
        return m.LlamaConfig, m.LlamaAttention, m.LlamaRotaryEmbedding
    if family == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m
        return m.Qwen2Config, m.Qwen2Attention, m.Qwen2RotaryEmbedding
    if family == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m
        return m.Qwen3Config, m.Qwen3Attention, m.Qwen3RotaryEmbedding
    from transformers.models.mistral import modeling_mistral as m
    return m.MistralConfig, m.MistralAttention, m.MistralRotaryEmbedding


class HFPrefill(nn.Module):
    """hidden_states [B, T, E] -> the attention module's output, positions 0..T-1, causal mask as an input-free constant."""

    def __init__(self, family: str, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        config_cls, attn_cls, rope_cls = _classes(family)
        config = config_cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, intermediate_size=4 * hidden, num_hidden_layers=1,
                            max_position_embeddings=256, attention_dropout=0.0)
        config._attn_implementation = "eager"
        self.attn, self.rope = attn_cls(config, layer_idx=0).eval(), rope_cls(config)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t)[None].expand(b, t)
        cos, sin = self.rope(hidden_states, position_ids)
        mask = torch.full((t, t), torch.finfo(hidden_states.dtype).min).triu(1)[None, None]
        out, _ = self.attn(hidden_states, (cos, sin), mask)
        return out
