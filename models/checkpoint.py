"""Whole-model checkpoints for the LM: a MiniMind `.pth`, or a Hugging Face folder.

Whole-model checkpoints for the LM: a MiniMind `.pth` state dict as its training scripts save it, or a
Hugging Face folder (`config.json` + `model.safetensors`, or shards listed in `model.safetensors.index.json`),
whose dims come from its `config.json`.

A folder is built from one of two sources (`AttentionConfig.source`, `--source`):

- `course`: our course-literal MiniMind model (models/lm.py), for MiniMind and Qwen3ForCausalLM folders (the same
  architecture; the default for them);
- `transformers`: the folder's own modeling code through `AutoModelForCausalLM` (models/hf_step.py), for any
  decoder-only causal LM with softmax attention (full or sliding-window layers), RoPE or no rotary positions, one
  KV head count and head size in every layer, dense MLPs and text only. Anything else is refused in one line naming
  the architecture and the part that does not fit (encoder-decoder, multimodal, state-space or recurrent layers,
  mixture of experts, ALiBi, per-layer cache shapes), before any weights are read.

The course model's checkpoints name parameters as our LM does (`model.embed_tokens.weight`, `model.layers.N.*`,
`model.norm.weight`, `lm_head.weight`, which tied checkpoints may leave out). Anything that does not fit is one
WeightsError naming it: a missing, unexpected or mis-shaped key, or a config this model is not (MoE, attention biases,
another activation, scaled RoPE, sliding windows).
"""
from __future__ import annotations

import json
import math
from collections.abc import MutableMapping
from pathlib import Path

import torch

from .config import AttentionConfig
from .weights import WeightsError, _read, fit_

MODEL_TYPES = ("qwen3", "minimind")  # what the course model is: its source by default (source=auto)
SCOPE = ("a decoder-only causal LM with softmax attention (full or sliding-window layers), RoPE or no rotary "
         "positions, one KV head count and head size in every layer, dense MLPs, text only")
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_moe_experts")
STATE_SPACE = ("mamba", "ssm_", "state_size", "linear_num", "linear_key", "linear_value", "lru_width")


def config_from_folder(folder: str | Path, base: AttentionConfig) -> AttentionConfig:
    """`base` (capacity, chunk, batch, dtype) with the model's dims read from the folder's config.json, and `source`
    decided: `course` (our MiniMind model, for MiniMind and Qwen3 folders: the default for them) or `transformers`
    (the folder's own modeling code: any other decoder-only LM, or a Qwen3 folder with source=transformers)."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path}: not found; expected a Hugging Face model folder with config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    source = base.source if base.source != "auto" else ("course" if kind in MODEL_TYPES else "transformers")
    if source == "transformers":
        return _transformers_config(path, cfg if isinstance(cfg, dict) else {}, base)
    if kind not in MODEL_TYPES:
        raise WeightsError(f"{path}: model_type {kind!r}; the course model reads {', '.join(MODEL_TYPES)} "
                           "(MiniMind's causal LM, or Qwen3ForCausalLM: the same architecture); --source transformers "
                           "(or auto) builds any other decoder-only LM from transformers' modeling code")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    unsupported = [what for what, bad in (
        ("mixture of experts (use_moe / num_experts)", cfg.get("use_moe") or cfg.get("num_experts")),
        ("attention biases (attention_bias)", cfg.get("attention_bias")),
        (f"activation {cfg.get('hidden_act')!r}", cfg.get("hidden_act", "silu") != "silu"),
        (f"RoPE type {rope.get('rope_type', rope.get('type'))!r}", rope.get("rope_type", rope.get("type", "default")) != "default"),
        ("sliding-window attention (use_sliding_window)", cfg.get("use_sliding_window")),
    ) if bad]
    if unsupported:
        raise WeightsError(f"{path}: unsupported config: {'; '.join(unsupported)}; expected a dense model with "
                           "SwiGLU, unbiased projections and plain RoPE")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size") if k not in cfg]
    if missing:
        raise WeightsError(f"{path}: no {', '.join(missing)}; expected the model's dims in config.json")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return base.replace(
        hidden_size=hidden, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg.get("intermediate_size") or 64 * math.ceil(hidden * math.pi / 64),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
        vocab_size=cfg["vocab_size"], num_layers=cfg["num_hidden_layers"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), qk_norm=True, source="course")


def _transformers_config(path: Path, cfg: dict, base: AttentionConfig) -> AttentionConfig:
    """The dims of a model transformers builds from its own modeling code, or one WeightsError naming the
    architecture and the part of it outside the scope (SCOPE), before any weights are read."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = cfg.get("model_type")
    arch = ", ".join(cfg.get("architectures") or []) or f"model_type {kind!r}"
    refuse = lambda why: WeightsError(f"{path}: {arch} is {why}; expected {SCOPE}")  # noqa: E731
    if not kind:
        raise WeightsError(f"{path}: no model_type; expected a Hugging Face config.json naming its architecture")
    try:
        hf = AutoConfig.from_pretrained(str(path.parent))
    except Exception as e:  # transformers raises ValueError or KeyError for an unknown model_type
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise WeightsError(f"{path}: model_type {kind!r}: transformers {transformers.__version__} cannot build its "
                           f"config ({first}); expected {SCOPE}, of a model_type transformers knows") from None
    if getattr(hf, "is_encoder_decoder", False):
        raise refuse("an encoder-decoder model (is_encoder_decoder), not decoder-only")
    others = [k for k in getattr(hf, "sub_configs", {}) or {} if k != "text_config"]
    if others:
        raise refuse(f"multimodal ({', '.join(others)} beside the text model), not text only")
    text = hf.get_text_config(decoder=True)
    if not getattr(text, "num_attention_heads", None):
        raise refuse("without attention heads (no num_attention_heads: a state-space or recurrent model), not softmax "
                     "attention")
    for field in ("layer_types", "block_types", "layers_block_type"):
        odd = sorted({str(t) for t in getattr(text, field, None) or []} - set(ATTENTION_LAYERS) - {"attention"})
        if odd:
            raise refuse(f"a hybrid with {', '.join(odd)} layers ({field}), not softmax attention in every layer")
    ssm = [k for k, v in text.to_dict().items() if v and any(w in k for w in STATE_SPACE)]
    if ssm:
        raise refuse(f"a state-space or linear-attention model ({', '.join(ssm)}), not softmax attention")
    experts = [f"{k}={getattr(text, k)}" for k in EXPERT_COUNTS if (getattr(text, k, None) or 0) > 1][:1]
    if experts or "sparse" in (getattr(text, "mlp_layer_types", None) or []):
        raise refuse(f"a mixture of experts ({', '.join(experts) or 'mlp_layer_types sparse'}), not dense MLPs")
    if getattr(text, "alibi", False):
        raise refuse("positioned by ALiBi biases (alibi), not RoPE or no rotary positions")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise refuse(f"not a causal LM transformers {transformers.__version__} builds (AutoModelForCausalLM has no "
                     f"class for model_type {kind!r})")
    from transformers.configuration_utils import get_head_shapes
    kv_heads, head_dim = get_head_shapes(text)
    if isinstance(kv_heads, list) or isinstance(head_dim, list):
        raise refuse(f"a model whose layers differ in KV heads or head size (per layer: {kv_heads}, {head_dim}), "
                     "not one cache shape for every layer")
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    eps = getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None)
    return base.replace(
        hidden_size=text.hidden_size, num_heads=text.num_attention_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=getattr(text, "intermediate_size", None) or 0, vocab_size=text.vocab_size,
        num_layers=text.num_hidden_layers, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        **({"rope_theta": float(theta)} if theta else {}), **({"rms_eps": float(eps)} if eps else {}),
        source="transformers")


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor] | SafetensorsFolder:
    path = Path(path)
    if not path.is_dir():
        return _read(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise WeightsError(f"{index}: not a safetensors index with a weight_map ({e})") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise WeightsError(f"{path}: no model.safetensors or model.safetensors.index.json; expected a Hugging Face "
                           "model folder")
    return SafetensorsFolder([path / name for name in files])


class SafetensorsFolder(MutableMapping):
    """A folder's tensors by name, each read from its file when asked for, its shape from the file's header. Read whole,
    a 0.6B bf16 checkpoint was 1.2 GB beside the 2.4 GB fp32 model it fills; read a tensor at a time, one tensor is.
    A name set here (a tied lm_head) holds its tensor."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open
        self._file, self._shape, self._set = {}, {}, {}
        for file in files:
            try:
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        self._file[name], self._shape[name] = file, tuple(f.get_slice(name).get_shape())
            except Exception as e:
                raise WeightsError(f"{file}: cannot be read as safetensors ({str(e).strip()[:160]})") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._set:
            return self._set[name]
        from safetensors import safe_open
        with safe_open(str(self._file[name]), "pt") as f:  # opened per tensor: an open file keeps its pages mapped
            return f.get_tensor(name)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._set[name], self._shape[name] = tensor, tuple(tensor.shape)

    def __delitem__(self, name: str) -> None:
        raise TypeError("a checkpoint's tensors are read, not deleted")

    def __iter__(self):
        return iter(self._shape)

    def __len__(self) -> int:
        return len(self._shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]


def load_lm_(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Copy a whole-model checkpoint into `model` (a MiniMindForCausalLM), or fail naming what does not fit."""
    state = read_checkpoint(path)
    embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if model.config.tie_embeddings and embed is not None:
        if head is not None and not torch.equal(head, embed):
            raise WeightsError(f"checkpoint {path}: lm_head.weight differs from model.embed_tokens.weight, but the "
                               "config ties them; expected tie_word_embeddings false for this checkpoint")
        state["lm_head.weight"] = embed
    return fit_(model, state, f"checkpoint {path}")


def folder_extras(folder: str | Path) -> dict:
    """What a generation loop wants from a Hugging Face folder besides weights: end-of-sequence ids
    (config.json or generation_config.json) and the tokenizer file, where they exist."""
    folder, eos = Path(folder), []
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if value is not None:
            eos = sorted(set(value if isinstance(value, list) else [value]))
            break
    tokenizer = folder / "tokenizer.json"
    return {"eos_token_ids": eos, "tokenizer": tokenizer if tokenizer.is_file() else None}


def save_hf_folder(model: torch.nn.Module, folder: str | Path, model_type: str = "qwen3") -> Path:
    """Write the LM as a Hugging Face folder (config.json + model.safetensors) of a Qwen3ForCausalLM (or a
    MiniMind model): what other tools, onnxruntime-genai's model builder among them, load."""
    from safetensors.torch import save_file
    c, folder = model.config, Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "MiniMindForCausalLM"],
              "model_type": model_type, "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate_size": c.ffn_size,
              "num_hidden_layers": c.num_layers, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_eps,
              "rope_theta": c.rope_theta, "rope_scaling": None, "tie_word_embeddings": c.tie_embeddings,
              "hidden_act": "silu", "attention_bias": False, "max_position_embeddings": max(c.capacity, 32768),
              "torch_dtype": "float16" if c.dtype == "fp16" else "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if c.tie_embeddings:
        state.pop("lm_head.weight")  # safetensors keeps one copy of a tied tensor; loaders re-tie it
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
