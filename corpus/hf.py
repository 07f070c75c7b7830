"""Eager attention modules as Hugging Face transformers writes them, for the fusion corpus.

Eager attention modules as Hugging Face transformers writes them (random weights, no downloads),
wrapped to run a prefill over T tokens with an explicit additive mask: causal, and for Gemma-2 (a
sliding-window layer with logit soft-capping) causal within the window."""
from __future__ import annotations

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")
WINDOW = 6  # Gemma-2's sliding window, narrower than the prefill so the band shows


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
    if family == "gemma2":
        from transformers.models.gemma2 import modeling_gemma2 as m
        return m.Gemma2Config, m.Gemma2Attention, m.Gemma2RotaryEmbedding
    from transformers.models.mistral import modeling_mistral as m
    return m.MistralConfig, m.MistralAttention, m.MistralRotaryEmbedding


class HFPrefill(nn.Module):
    """hidden_states [B, T, E] -> the attention module's output, positions 0..T-1, mask as an input-free constant."""

    def __init__(self, family: str, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        config_cls, attn_cls, rope_cls = _classes(family)
        extra = dict(attn_logit_softcapping=2.0, sliding_window=WINDOW, layer_types=["sliding_attention"],
                     query_pre_attn_scalar=head_dim) if family == "gemma2" else {}
        config = config_cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, intermediate_size=4 * hidden, num_hidden_layers=1,
                            max_position_embeddings=256, attention_dropout=0.0, **extra)
        config._attn_implementation = "eager"
        self.window = extra.get("sliding_window")
        self.attn, self.rope = attn_cls(config, layer_idx=0).eval(), rope_cls(config)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        position_ids = torch.arange(t)[None].expand(b, t)
        cos, sin = self.rope(hidden_states, position_ids)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None]
        visible = (j <= i) & ((i - j < self.window) if self.window else True)
        mask = torch.zeros(t, t).masked_fill(~visible, torch.finfo(hidden_states.dtype).min)[None, None]
        out, _ = self.attn(hidden_states, (cos, sin), mask)
        return out


def causal_lm(family: str, layers: int = 2, vocab: int = 128) -> nn.Module:
    """A whole transformers causal LM of the family (eager attention, random weights, no cache):
    input_ids [B, T] -> logits [B, T, vocab]. Gemma-2 alternates sliding-window and full layers."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, num_hidden_layers=layers, max_position_embeddings=64, use_cache=False)
    if family == "gemma2":
        config = tf.Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                 sliding_window=WINDOW, query_pre_attn_scalar=16)
    else:
        config = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config, "qwen2": tf.Qwen2Config,
                  "mistral": tf.MistralConfig}[family](**common)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _Logits(tf.AutoModelForCausalLM.from_config(config).eval())


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits
