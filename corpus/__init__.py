"""The fusion corpus: attention graphs exported by torch.onnx from common ways of writing attention.

Each case is an eager module, example inputs, and how it is exported; `export_case`
gives the raw ONNX graph the passes start from. Cached cases keep the step contract;
padded cases take a key-padding mask after the hidden states.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from export.torch_export import export_module
from models import AttentionConfig, build_model, init_random_, preset
from models.contract import INPUTS, OUTPUTS, example_inputs

from .variants import EncoderAttention, Variant, VariantAttention

CONFIG = preset("tiny")

VARIANTS = [
    Variant("course: repeat_kv, /sqrt(D), masked_fill -inf, fp32 softmax, scatter"),
    Variant("mul scale, index_copy", scale="mul", write="index_copy"),
    Variant("scale folded into Q, index_put, finfo.min mask", scale="q", write="index_put", mask="finfo"),
    Variant("scale folded into K, offset slice write, additive -1e9 mask", scale="k", write="offset_put", mask="additive"),
    Variant("no scale, repeat_interleave, softmax(dtype=float32)", scale="none", repeat="repeat_interleave", softmax="dtype"),
    Variant("Q scaled before its transpose", scale="q_early"),
    Variant("permute(0,1,3,2), expand+flatten repeat, plain softmax", scores="permute", repeat="expand_flatten", softmax="plain"),
    Variant("K.mT, mul scale, expand+flatten", scores="mT", scale="mul", repeat="expand_flatten"),
    Variant("no cache: constant causal triu", mask="triu", write="none"),
    Variant("SDPA (opset 23 Attention) after repeat_kv, cached", sdpa=True),
    Variant("SDPA (opset 23 Attention) after repeat_interleave, no cache", sdpa=True, repeat="repeat_interleave", write="none"),
    Variant("einsum bhtd,bhsd->bhts after repeat_kv", einsum=True),
    Variant("grouped einsum bgrtd,bgsd->bgrts, no repeat", einsum=True, group="grouped"),
    Variant("grouped matmul, no repeat: Q as [B, Hkv, rep*T, D], mask repeated", group="fold"),
    Variant("soft-capping cap * tanh(s / cap) before the mask (Gemma-2)", softcap=2.0),
]
# The ops each target ends with: GroupQueryAttention masks causally, so non-causal masks keep the standard op on ort.
CAUSAL = {"onnx": "Attention", "ort": "GroupQueryAttention"}
NOT_CAUSAL = {"onnx": "Attention", "ort": "Attention"}


@dataclass
class Case:
    name: str
    module: torch.nn.Module
    config: AttentionConfig
    seq_len: int
    cached: bool
    opset: int = 20
    padded: bool = False
    expect: dict = field(default_factory=lambda: CAUSAL)
    rotary: bool = True

    @property
    def input_names(self) -> tuple:
        return INPUTS if self.cached else ("hidden_states", "attention_mask") if self.padded else INPUTS[:1]

    @property
    def output_names(self) -> tuple:
        return OUTPUTS if self.cached else OUTPUTS[:1]

    def inputs(self, p0: int = 0, seed: int = 0) -> tuple:
        """Eager/graph inputs: the contract's for cached cases (positions from p0), hidden_states and a key-padding
        mask (the last quarter of each row padding) for padded ones, else hidden_states alone."""
        args = example_inputs(self.config, self.seq_len, p0, seed)
        if self.padded:
            keep = torch.ones(self.config.batch, self.seq_len)
            keep[:, -self.seq_len // 4:] = 0.0
            return args[0], keep
        return args if self.cached else args[:1]


def variant_case(variant: Variant, config=CONFIG, suffix="", decode=False) -> Case:
    module = init_random_(VariantAttention(config, variant), seed=1).to(config.torch_dtype).eval()
    return Case(variant.name + suffix, module, config, 1 if decode else config.chunk, variant.cached,
                23 if variant.sdpa else 20)


def _hf_case(family: str) -> Case:
    from .hf import HFPrefill
    c = CONFIG
    module = init_random_(HFPrefill(family, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim), seed=2).eval()
    what = "soft-capping, sliding-window mask" if family == "gemma2" else "causal mask"
    return Case(f"transformers {family} eager attention, prefill with {what}", module, c, c.chunk, False)


def _encoder_case(name: str, padding: str, causal: bool = False) -> Case:
    module = init_random_(EncoderAttention(CONFIG, padding, causal), seed=3).eval()
    return Case(name, module, CONFIG, CONFIG.chunk, False, padded=True, expect=NOT_CAUSAL, rotary=False)


def _own_case(kind: str, step: str) -> Case:
    name = "attention block" if kind == "attention" else "decoder block"
    return Case(f"this project's {name}, {step}", build_model(CONFIG, kind), CONFIG,
                CONFIG.chunk if step == "prefill" else 1, True)


def cases(transformers: bool = True) -> list[Case]:
    from .hf import FAMILIES
    out = [variant_case(v) for v in VARIANTS]
    out.append(variant_case(VARIANTS[0], suffix=", decode", decode=True))
    out.append(variant_case(VARIANTS[0], CONFIG.replace(dtype="fp16"), suffix=", fp16 (fp32 softmax between Casts)"))
    out.append(variant_case(Variant("MHA (H == Hkv), no repeat", softmax="plain"), CONFIG.replace(num_kv_heads=4)))
    out.append(variant_case(VARIANTS[-2], suffix=", decode", decode=True))
    out += [_encoder_case("encoder self-attention, key-padding mask (1 - keep[:, None, None, :]) * -10000", "additive"),
            _encoder_case("encoder self-attention, boolean key-padding masked_fill", "bool"),
            _encoder_case("padded decoder prefill: causal and key-padding masks", "bool", causal=True)]
    out += [_own_case(kind, step) for kind in ("attention", "block") for step in ("prefill", "decode")]
    if transformers:
        out += [_hf_case(f) for f in FAMILIES]
    return out


def export_case(case: Case):
    return export_module(case.module, case.inputs(), case.input_names, case.output_names, case.opset)
