"""manifest.json: what a consumer of the graphs needs to run them without our code."""
from __future__ import annotations

import onnx
import onnxruntime
import torch

from models import AttentionConfig

FORMAT = 1


LM = {
    "inputs": "input_ids [B,T] int64 (int32 for npu), position_ids, one past_key.i/past_value.i pair per layer i",
    "logits": "logits [B,1,V] of the step's last position only: a prompt is fed so that its last token is the last "
              "row of a step (a partial chunk first, right-padded; a prompt shorter than T as a padded chunk of all "
              "but its last token, then a decode step); see runtime/drivers.py Driver.feed",
    "generation": "python -m runtime.generate FOLDER --target {raw,onnx,ort,npu} --chat TEXT | --prompt TEXT (with the "
                  "tokenizer files copied beside the graphs) | --prompt-ids 1,2,3",
}


def attention_layers(windows: list[int | None]) -> dict:
    """lm.attention: which layers are local (attend within a sliding window) and their windows."""
    return {"windows": windows, "local_layers": [i for i, w in enumerate(windows) if w],
            "rule": "windows[i] is layer i's sliding window W: its query at position p attends to rows p-W+1..p only "
                    "(its cache still holds every row; npu graphs take that band as input attention_mask.slidingW); "
                    "null: causal over every cached row"}


def build_manifest(config: AttentionConfig, kind: str, name: str, opset: int, graphs: list[dict],
                   sequence_parity: dict, weights: dict, lm: dict | None = None, windows: tuple[int, ...] = ()) -> dict:
    return {
        "format": FORMAT,
        "name": name,
        "kind": kind,
        "config": config.to_dict(),
        "opset": opset,
        "weights": weights,
        "cache": {
            "layout": "[B, Hkv, C, D]",
            "shape": [config.batch, config.num_kv_heads, config.capacity, config.head_dim],
            "dtype": "float16" if config.dtype == "fp16" else "float32",
            "holds": "K after q/k norm and RoPE, and V, at their absolute positions",
            "update": "present_* = past_* with the rows at position_ids written; rows after the last written "
                      "position are unspecified and must not be relied on",
        },
        "windows": {
            "sizes": list(windows) or [config.capacity],
            "rule": "each step and target is exported once per window W (graphs[].window), over a cache [B, Hkv, W, D] "
                    "(npu: attention_mask [B, 1, T, W+T]) and attending over those W rows only; run a step in the "
                    "smallest W with p0 + T <= W, moving rows 0..p0-1 into that layout when W changes "
                    "(runtime/drivers.py)",
        },
        "positions": {
            "input": "position_ids [B, T] int64",
            "rule": "each row p0, p0+1, ..., p0+T-1 with 0 <= p0 and p0+T <= C",
            "causality": "the query at position p attends to cache rows 0..p, whatever the later rows hold",
            "prefill": f"prompts longer than T={config.chunk} go in chunks; the last chunk is right-padded "
                       "and its padded outputs are ignored",
        },
        **({"lm": LM | {"vocab_size": config.vocab_size, "num_layers": config.num_layers,
                        "tie_embeddings": config.tie_embeddings} | (lm or {})} if kind == "lm" else {}),
        "graphs": graphs,
        "sequence_parity": {"reference": "eager PyTorch full-sequence forward without a cache, fp32"
                            + (", at every step of its own greedy continuation (teacher forcing)" if kind == "lm" else ""),
                            "targets": sequence_parity},
        "versions": {m.__name__: m.__version__ for m in (torch, onnx, onnxruntime)},
    }
