"""The workloads, and what each must at least cost: bytes for decode, FLOPs for prefill.

`attention` and `block` workloads time one step: prefill@P is a chunk of T at position P,
decode@P one token at P. The whole model's (`lm/`) are what a user of generation waits for:
lm/prefill@N is the time to first token for an N-token prompt (fed in chunks), lm/decode@P
the time per token with P tokens in the cache. A trained model's (`smollm2/`: models.fetch's
SmolLM2-135M-Instruct, its dims from its folder) are the same whole-model workloads on real weights,
beside onnxruntime-genai and llama.cpp built from the same folder. A deployed checkpoint's shape (`qwen3-0.6b/`:
benchmarks.scale's random-weight folder) runs them at a size people deploy, our ort graphs beside
onnxruntime-genai's builds of the same folder.
"""
from __future__ import annotations

from dataclasses import dataclass

import registry
from models import AttentionConfig

TRAINED = ("smollm2",)  # trained models, by their models.fetch name: whole-model workloads on real weights
# random weights in a deployed checkpoint's shape, by benchmarks.scale's name: whole-model speed at that size
SCALED = ("qwen3-0.6b",)
FOLDER_MODELS = TRAINED + SCALED  # whole models read from a Hugging Face folder, their dims the folder's
KINDS = ("attention", "block", "lm", *FOLDER_MODELS)
TORCH = ("torch-eager", "torch-sdpa", "torch-compile")


def engine(target: str) -> str:
    """The engine running a target's graphs in onnxruntime: ort-npu, ort-ort-int4."""
    return f"ort-{target}"


def target_of(name: str) -> str | None:
    """The registry's target an onnxruntime engine runs, or None (a peer, eager, or not one of ours)."""
    t = name.removeprefix("ort-").removesuffix("-single")
    return t if name.startswith("ort-") and t in registry.TARGETS else None


_FLOAT = registry.float_targets()
# the ort engines run each float target's window ladder, and onnxscript's optimize_for_ort of the raw graphs
ORT = (engine(_FLOAT[0]), "ort-onnxscript", *map(engine, _FLOAT[1:]))
# the graphs that attend over their whole window (standard ops, not a contrib kernel reading the rows in use) over all
# C rows, as before the ladder
SINGLE = tuple(engine(t) + "-single" for t in _FLOAT if registry.target(t).fuses and not registry.target(t).contrib)
GENAI = ("genai-fp32", "genai-int4")
# the whole model's quantized targets a pass makes (export --quant int4,int8)
QUANT = tuple(engine(t) for t in registry.pipeline_targets() if registry.target(t).scheme)
# The same weights written as a Qwen3 folder and exported from transformers' own Qwen3ForCausalLM (--source
# transformers), its ort graphs: what the passes make of code nobody wrote for them, beside the course model's.
HF = ("ort-ort-hf",)
# llama.cpp (llama-cpp-python) on GGUFs of a trained model's folder: F32 and Q4_0 converted from it, and its original Q4_1
LLAMACPP = ("llamacpp-f32", "llamacpp-q4_0", "llamacpp-q4_1")
# Bits read per weight, scales included, the fewest any of an engine's layers reads (a floor is a lower bound): ours
# int4 an fp32 scale and an fp32 minimum term per block of 32 (its lm_head int8: 9), int8 and genai-int4 one fp32
# scale per 32, Q4_0 one fp16 scale per 32, Q4_1 a scale and a minimum; the embedding's Gather reads one row a token.
WEIGHT_BITS = {engine(t): registry.target(t).scheme.weight_bits for t in registry.pipeline_targets()
               if registry.target(t).scheme} | {"genai-int4": 5, "llamacpp-q4_0": 4.5, "llamacpp-q4_1": 5}
QUICK_LM = ("torch-eager", "ort-ort", "ort-ort-int4", "genai-fp32", "genai-int4")
TRAINED_ENGINES = ("torch-eager", "ort-onnx", "ort-ort", "ort-npu") + QUANT + GENAI + LLAMACPP
SCALED_ENGINES = ("ort-ort", "ort-ort-int4") + GENAI  # our fp32 and int4 against genai's, the same folder


@dataclass(frozen=True)
class Workload:
    kind: str      # attention | block | lm | a folder's model (FOLDER_MODELS)
    step: str      # prefill | decode
    p0: int        # the cache holds rows 0..p0-1 before the step; for lm/prefill, the prompt length
    quick: bool = False

    @property
    def name(self) -> str:
        return ("" if self.kind == "attention" else f"{self.kind}/") + f"{self.step}@{self.p0}"

    @property
    def lm(self) -> bool:
        """A whole model's workload (random or trained weights): token ids in, the last position's logits out."""
        return self.kind == "lm" or self.kind in FOLDER_MODELS

    @property
    def engines(self) -> tuple[str, ...]:
        if self.kind in TRAINED:
            return TRAINED_ENGINES
        if self.kind in SCALED:
            return SCALED_ENGINES
        if self.kind != "lm":
            return TORCH + ORT + SINGLE
        return QUICK_LM if self.quick else TORCH + ORT + SINGLE + QUANT + HF + GENAI

    def seq_len(self, c: AttentionConfig) -> int:
        """Tokens the workload processes."""
        if self.step == "decode":
            return 1
        return self.p0 if self.lm else c.chunk

    def start(self) -> int:
        """Position of the workload's first token."""
        return 0 if self.lm and self.step == "prefill" else self.p0

    def weight_bytes(self, c: AttentionConfig) -> int:
        """Weights a step reads: the attention's, a block's, or every layer's and the lm_head's (the embedding
        table is read a row per token, tied or not)."""
        e, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        params = 2 * e * qd + 2 * e * kvd + (2 * c.head_dim if c.qk_norm else 0)
        if self.kind != "attention":
            params += 3 * e * c.ffn_size + 2 * e
        if self.lm:
            params = c.num_layers * params + e * c.vocab_size + e
        return params * _elem(c)

    def cache_bytes(self, c: AttentionConfig) -> int:
        """K and V rows a step must read: the live part of every cache, up to and including its own rows."""
        layers = c.num_layers if self.lm else 1
        return 2 * layers * c.batch * c.num_kv_heads * (self.start() + self.seq_len(c)) * c.head_dim * _elem(c)

    def working_set(self, c: AttentionConfig, engine: str = "") -> int:
        """Bytes a step must read; an engine with quantized weights reads its bits per weight (scales included)."""
        return int(self.weight_bytes(c) * WEIGHT_BITS.get(engine, 32) / 32) + self.cache_bytes(c)

    def flops(self, c: AttentionConfig) -> int:
        t, e, d = c.batch * self.seq_len(c), c.hidden_size, c.head_dim
        proj = 2 * t * e * (2 * c.num_heads * d + 2 * c.num_kv_heads * d)
        live = self.start() + self.seq_len(c)
        attn = 2 * 2 * t * live * c.num_heads * d  # QK^T and PV over live rows (prefill from 0: half of it is masked)
        if self.lm and self.step == "prefill":
            attn //= 2
        mlp = 2 * t * e * c.ffn_size * 3 if self.kind != "attention" else 0
        if not self.lm:
            return proj + attn + mlp
        return c.num_layers * (proj + attn + mlp) + 2 * c.batch * e * c.vocab_size  # logits of the last position


def _elem(c: AttentionConfig) -> int:
    return 2 if c.dtype == "fp16" else 4


def workloads(configs: dict[str, AttentionConfig], quick: bool) -> list[Workload]:
    """Every workload of the kinds in `configs` (kind -> the config its model has)."""
    if quick:  # the preset's attention and lm workloads alone: every config here is the preset's
        c = next(iter(configs.values()))
        return [Workload("attention", "decode", min(1024, c.capacity - 1)), Workload("attention", "prefill", 0),
                Workload("lm", "decode", min(1024, c.capacity - 1), quick=True),
                Workload("lm", "prefill", min(128, c.capacity), quick=True)]
    out = []
    for kind, c in configs.items():
        if kind in ("attention", "block"):
            points = [("prefill", 0), ("prefill", min(1024, c.capacity - c.chunk)), ("decode", min(128, c.capacity - 1)),
                      ("decode", min(1024, c.capacity - 1)), ("decode", c.capacity - 1)]
            out += [Workload(kind, step, p0) for step, p0 in points]
        else:  # the time to first token of a 128- and a 1024-token prompt, and a token at those contexts
            out += [Workload(kind, "prefill", n) for n in dict.fromkeys(min(n, c.capacity) for n in (128, 1024))]
            out += [Workload(kind, "decode", n) for n in dict.fromkeys(min(n, c.capacity - 1) for n in (128, 1024))]
    return out
