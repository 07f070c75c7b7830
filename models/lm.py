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
        # tied: no [V, E] matrix of its own, not even for a moment (600 MB at a 150k vocabulary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 device="meta" if config.tie_embeddings else None)
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

    def forward_full(self, input_ids, keep: int = 0):
        """Logits [B, S, V] at every position of input_ids [B, S], positions 0..S-1, no cache (`keep`: at the last
        `keep` positions only, as transformers' logits_to_keep)."""
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer.forward_full(h)
        return self.lm_head(self.model.norm(h[:, -keep:] if keep else h))


@torch.no_grad()
def greedy(model: MiniMindForCausalLM, input_ids: torch.Tensor, new_tokens: int,
           config: AttentionConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager reference for generation: (the greedy continuation [B, N], the logits that chose each [B, N, V]),
    the logits from whole-sequence forwards without a cache.

    Without `config`, each token is a whole-sequence forward. With it (the model's step contract), the model's own
    cached steps propose the tokens and one whole-sequence forward over them gives the logits (a 0.6B model's
    16-step reference over a 1000-token prompt: one forward instead of 17); from the first token that forward would
    not have chosen (a near-tie between the two paths), the rest are whole-sequence forwards again."""
    if config is None or input_ids.shape[1] + new_tokens > config.capacity:
        return _greedy_full(model, input_ids, new_tokens)
    proposed = _greedy_cached(model, config, input_ids, new_tokens)
    logits = model.forward_full(torch.cat([input_ids, proposed[:, :-1]], dim=1), keep=new_tokens)
    agree = (logits.argmax(-1) == proposed).all(dim=0)
    kept = int(agree.long().cumprod(0).sum())
    if kept == new_tokens:
        return proposed, logits
    rest, rest_logits = _greedy_full(model, torch.cat([input_ids, proposed[:, :kept]], dim=1), new_tokens - kept)
    return torch.cat([proposed[:, :kept], rest], dim=1), torch.cat([logits[:, :kept], rest_logits], dim=1)


def _greedy_full(model, input_ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logits = input_ids, []
    for _ in range(new_tokens):
        last = model.forward_full(ids, keep=1)[:, -1]
        logits.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids[:, input_ids.shape[1]:], torch.stack(logits, dim=1)


def _greedy_cached(model, config: AttentionConfig, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens [B, N] from the model's step (`forward`): the prompt in steps of up to 256 tokens, then one token
    a step, over caches of just the rows the sequence needs."""
    from .contract import example_inputs
    b, p = input_ids.shape
    rows = p + new_tokens
    past = [torch.zeros(*c.shape[:2], rows, *c.shape[3:]) for c in example_inputs(config.replace(batch=b), 1, kind="lm")[2:]]
    pieces = list(input_ids.split(256, dim=1))
    tokens, pos = [], 0
    while len(tokens) < new_tokens:
        step = pieces.pop(0) if pieces else tokens[-1]
        t = step.shape[1]
        out, *past = model(step, (pos + torch.arange(t)).expand(b, t), *past)
        pos += t
        if not pieces:
            tokens.append(out[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)
