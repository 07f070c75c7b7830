"""Any Hugging Face decoder-only causal LM as the whole model's step, traced from transformers' own modeling code.

    lm_step(input_ids [B,T] int64, position_ids [B,T] int64, past_key.i/past_value.i [B,Hkv,C,D])
      -> logits [B,1,V] (last position), present_key.i/present_value.i [B,Hkv,C,D]

`HFStep` wraps an `AutoModelForCausalLM` (loaded with eager attention, the plain matmul-softmax-matmul chain the
passes fuse) and maps that step onto the model's cache interface:

- the caches are the step's inputs: `StepCache` hands the model one `_StepLayer` per layer whose `update` writes the
  new K/V rows at `position_ids` out of place (a per-row scatter along the rows, which the passes' fuse_cache_write
  matches) and returns the whole C-row cache, which is the layer's present;
- the attention masks come from `position_ids` alone (`_masks`), one row per batch row, so batch > 1 is right
  (transformers' own masks offset every row by one scalar): additive [B,1,T,C] masks, causal by absolute position,
  and for layers marked sliding a band `row > position - window` as well (every layer's cache keeps all C rows: ring
  caches of only the window are later work). A config with `layer_types` gets a dict keyed by layer type, the form
  transformers' models take for mixed layers;
- `forward_full(input_ids)` is transformers' own forward without a cache, logits at every position: the reference
  `models.lm.greedy`, the runtime's parity checks and the accuracy measure read.

No per-family code: whatever the family writes around its attention (soft-capping, scaled embeddings, RoPE variants,
q/k norms, biases, partial rotary) is traced as written, and the passes, not this file, find the attention in it.
"""
from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch
from torch import nn

from .config import AttentionConfig
from .weights import WeightsError

SLIDING = "sliding_attention"


@functools.cache
def _step_layer_class():
    """Defined lazily: importing transformers' cache classes takes a second; only a Hugging Face export needs them."""
    from transformers.cache_utils import StaticLayer

    class StepLayer(StaticLayer):
        """One layer's cache: the step's past tensors, the rows at `position_ids` written out of place by `update`."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, position_ids: torch.Tensor, sliding: bool):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.position_ids = keys, values, position_ids
            self.cumulative_length = position_ids[0, 0]  # read only by transformers' own masks, which we replace
            self.dtype, self.device = keys.dtype, keys.device
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
            self.is_sliding = sliding
            self.is_initialized = True

        def lazy_initialization(self, *args, **kwargs):
            raise AssertionError("a step's caches are its inputs; nothing is allocated")

        def update(self, key_states, value_states, *args, **kwargs):
            b, h, t, _ = key_states.shape
            rows = self.position_ids[:, None, :, None]
            self.keys = self.keys.scatter(2, rows.expand(b, h, t, self.k_head_dim), key_states.to(self.keys.dtype))
            self.values = self.values.scatter(2, rows.expand(b, h, t, self.v_head_dim),
                                              value_states.to(self.values.dtype))
            return self.keys, self.values

        def get_mask_sizes(self, *args, **kwargs):
            return self.max_cache_len, 0  # every mask spans the whole capacity, rows 0..C-1

        def get_seq_length(self):
            return self.cumulative_length

    return StepLayer


def sliding_layers(config) -> list[bool]:
    """Which layers attend within `config.sliding_window` only: those `layer_types` marks sliding, or, for a config
    without layer types, every layer when it has a sliding window (Mistral, Phi-3)."""
    types = getattr(config, "layer_types", None)
    if types:
        return [t == SLIDING for t in types]
    return [bool(getattr(config, "sliding_window", None))] * config.num_hidden_layers


class HFStep(nn.Module):
    """The lm step over a transformers causal LM (see the module docstring)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        self.text_config = model.config.get_text_config()
        self.sliding = sliding_layers(self.text_config)
        self._keeps = "logits_to_keep" in inspect.signature(model.forward).parameters

    def forward(self, input_ids, position_ids, *past):
        """past = (past_key.0, past_value.0, ...), each [B,Hkv,C,D] -> (logits [B,1,V], present_key.0, ...)."""
        from transformers.cache_utils import Cache
        layer = _step_layer_class()
        cache = Cache(layers=[layer(past[2 * i], past[2 * i + 1], position_ids, self.sliding[i])
                              for i in range(len(past) // 2)])
        keep = {"logits_to_keep": 1} if self._keeps else {}
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                         attention_mask=self._masks(position_ids, past[0]), **keep)
        return (out.logits[:, -1:], *[t for lay in cache.layers for t in (lay.keys, lay.values)])

    def attention_windows(self) -> list[int | None]:
        """Each layer's sliding window W (it attends over the last W positions), or None (causal over the cache)."""
        window = getattr(self.text_config, "sliding_window", None)
        return [window if local else None for local in self.sliding]

    def forward_full(self, input_ids, keep: int = 0):
        """Logits [B,S,V] at every position of input_ids [B,S] (positions 0..S-1): transformers' forward, no cache
        (`keep`: at the last `keep` positions only)."""
        if keep and self._keeps:
            return self.model(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return logits[:, -keep:].clone() if keep else logits

    def generate_greedy(self, input_ids, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' own generate, greedy, exactly `new_tokens` past input_ids [B,S]: (tokens [B,N], the logits that
        chose them [B,N,V]). Nothing stops it at eos or changes a logit: the folder's generation config would stop at
        its eos (min_new_tokens instead sets eos's logit to -inf, changing the reference), so it runs without one."""
        from transformers import GenerationConfig
        saved = self.model.generation_config
        self.model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
        try:
            with torch.no_grad():
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                          max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
        finally:
            self.model.generation_config = saved
        return out.sequences[:, input_ids.shape[1]:], torch.stack(out.logits, dim=1).float()

    def _masks(self, position_ids, cache):
        """Additive [B,1,T,C] masks from position_ids alone: causal by absolute position, banded for sliding layers."""
        rows = torch.arange(cache.shape[2], device=position_ids.device)[None, None, None, :]
        at = position_ids[:, None, :, None]
        neg = torch.finfo(cache.dtype).min
        full = torch.where(rows <= at, 0.0, neg).to(cache.dtype)
        window = getattr(self.text_config, "sliding_window", None)
        band = torch.where((rows <= at) & (at - rows < window), 0.0, neg).to(cache.dtype) if window else full
        if getattr(self.text_config, "layer_types", None):
            return {"full_attention": full, SLIDING: band}
        return band if any(self.sliding) else full


def load_hf_step(config: AttentionConfig, folder: str | Path) -> HFStep:
    """The folder's AutoModelForCausalLM (eager attention, in the config's dtype) wrapped as the lm step."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # load reports (e.g. a tied lm_head missing from the file) say nothing wrong
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager",
                                                           dtype=config.torch_dtype, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    found = (("missing keys", info.get("missing_keys")), ("unexpected keys", info.get("unexpected_keys")),
             ("mis-shaped keys", info.get("mismatched_keys")))
    misfits = [f"{what} {sorted(map(str, keys))[:4]}" + (f" (+{len(keys) - 4})" if len(keys) > 4 else "")
               for what, keys in found if keys]
    if misfits:  # transformers would only warn, and run with those weights random
        raise WeightsError(f"checkpoint {folder}: the weights do not fit {type(model).__name__}: {'; '.join(misfits)}; "
                           "expected the checkpoint its config.json describes")
    return HFStep(model).eval()
