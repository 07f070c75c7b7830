"""MiniMind's causal language model: token embedding -> L decoder blocks -> norm -> lm_head (tied).

    h      = embed_tokens(input_ids)
    h      = layers[i](h)            for i in 0..L-1, each the course's MiniMind block
    logits = lm_head(norm(h))        lm_head.weight is embed_tokens.weight when tied

Parameter names are MiniMind's (and Qwen3's, whose architecture this is): `model.embed_tokens`,
`model.layers.N.*`, `model.norm`, `lm_head`, so checkpoints of either load as they are.

- `forward` is the step of the export contract: T tokens at `position_ids` over one
  fixed-capacity cache pair per layer, returning the logits of the step's last position
  only (generation needs no other; see `Driver.feed` in runtime/drivers.py for how a prompt is chunked
  so that its last token is a step's last position) and every layer's updated cache;
- `forward_cat` is MiniMind's own cached step, its caches growing by concatenation (what the
  benchmark's eager engines run);
- `forward_full` is the plain whole-sequence forward with no cache: logits at every position.
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import RMSNorm
from .block import MiniMindBlock
from .config import AttentionConfig


class MiniMindModel(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMindBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)


class MiniMindForCausalLM(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids, *past):
        """past = (past_key.0, past_value.0, past_key.1, ...), each [B, Hkv, C, D].

        Returns (logits [B, 1, V] at the last position, present_key.0, present_value.0, ...).
        """
        h = self.model.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.model.layers):
            h, key, value = layer(h, position_ids, past[2 * i], past[2 * i + 1])
            presents += [key, value]
        return (self.lm_head(self.model.norm(h[:, -1:])), *presents)

    def attention_windows(self) -> list[None]:
        """No sliding windows: every MiniMind layer attends over its whole cache."""
        return [None] * len(self.model.layers)

    def forward_cat(self, input_ids, position_ids, past=None):
        """Logits [B, 1, V] at the last position and every layer's grown (K, V) ([B, S, Hkv, D] each)."""
        h = self.model.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.model.layers):
            h, present = layer.forward_cat(h, position_ids, past[i] if past else None)
            presents.append(present)
        return self.lm_head(self.model.norm(h[:, -1:])), presents

    def forward_full(self, input_ids):
        """Logits [B, S, V] at every position of input_ids [B, S], positions 0..S-1, no cache."""
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer.forward_full(h)
        return self.lm_head(self.model.norm(h))


@torch.no_grad()
def greedy(model: MiniMindForCausalLM, input_ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager reference for generation: (the greedy continuation [B, N], the logits that chose each [B, N, V]),
    each step a whole-sequence forward without a cache."""
    ids, logits = input_ids, []
    for _ in range(new_tokens):
        last = model.forward_full(ids)[:, -1]
        logits.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids[:, input_ids.shape[1]:], torch.stack(logits, dim=1)
