"""The passes on transformers' own decoder code, traced with a cache: RoPE computed from position_ids (no table
to gather from), interleaved RoPE (Cohere), partial rotary with a Split (GPT-NeoX), sliding windows (Mistral).

The graphs are made here from a minimal step wrapper (caches as inputs and outputs, written with index_copy at
the step's positions), not by models/hf_step.py, so that the passes are tested on their own. Every target that
fuses is run in onnxruntime against eager PyTorch."""
import collections
import logging

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import transformers as tf
from transformers.cache_utils import Cache, StaticLayer

from export.torch_export import export_module
from passes.pipeline import run_pipeline
from runtime.drivers import host_mask, mask_inputs

C, T = 32, 8
SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.5,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {"llama": {}, "cohere": {}, "gpt_neox": dict(rotary_pct=0.25), "mistral": dict(sliding_window=4)}


class _Layer(StaticLayer):
    """One layer's cache: the step's past tensors, written out of place at the step's positions."""

    def __init__(self, keys, values, positions):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.positions = keys, values, positions
        self.cumulative_length = positions[0]  # the query offset transformers' masks read
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = self.keys.index_copy(2, self.positions, key_states)
        self.values = self.values.index_copy(2, self.positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length


class Step(torch.nn.Module):
    """(input_ids [1,T], position_ids [1,T], past_key.i, past_value.i ...) -> (logits [1,1,V], present ...)."""

    def __init__(self, model):
        super().__init__()
        self.model = model.eval()

    def forward(self, input_ids, position_ids, *past):
        cache = Cache(layers=[_Layer(past[i], past[i + 1], position_ids[0]) for i in range(0, len(past), 2)])
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return (out.logits, *(t for layer in cache.layers for t in (layer.keys, layer.values)))


def hf_model(family):
    torch.manual_seed(0)
    small = {k: v for k, v in SMALL.items() if not (family == "gpt_neox" and k in ("num_key_value_heads", "head_dim"))}
    config = tf.AutoConfig.for_model(family, **small, **FAMILIES[family])
    logging.disable(logging.WARNING)
    try:
        return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    finally:
        logging.disable(logging.NOTSET)


def step_inputs(model, t, p0, seed):
    config = model.config
    g = torch.Generator().manual_seed(seed)
    kv = getattr(config, "num_key_value_heads", config.num_attention_heads)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    caches = [torch.randn(1, kv, C, dim, generator=g) for _ in range(2 * config.num_hidden_layers)]
    return (torch.randint(0, config.vocab_size, (1, t), generator=g), (p0 + torch.arange(t))[None], *caches)


_exports = {}


def exported(family, t):
    """(fresh graph, step, input names): the step exported once per family and T."""
    if (family, t) not in _exports:
        step = Step(hf_model(family))
        layers = step.model.config.num_hidden_layers
        names = ["input_ids", "position_ids"] + [f"past_{kv}.{i}" for i in range(layers) for kv in ("key", "value")]
        outs = ["logits"] + [f"present_{kv}.{i}" for i in range(layers) for kv in ("key", "value")]
        graph = export_module(step, step_inputs(step.model, t, 0, 0), names, outs)
        _exports[family, t] = (ir.serde.serialize_model(graph), step, names)
    proto, step, names = _exports[family, t]
    return ir.serde.deserialize_model(proto), step, names


def fused(family, t, target):
    """(graph after the target's pipeline, {pass: report entry}, step, input names)."""
    model, step, names = exported(family, t)
    report = run_pipeline(model, target)
    return model, {p["pass"]: p for p in report["passes"]}, step, names


def parity(model, step, names, t, npu=False):
    """Max abs error of logits and the written cache rows against eager PyTorch, over starts 0, mid, last."""
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    worst = 0.0
    for p0 in sorted({0, (C - t) // 2, C - t}):
        args = step_inputs(step.model, t, p0, seed=p0 + 3)
        with torch.no_grad():
            want = [x.numpy() for x in step(*args)]
        feeds = {n: x.numpy() for n, x in zip(names, args)}
        if npu:
            feeds = {n: x.astype(np.int32) if x.dtype == np.int64 else x for n, x in feeds.items()}
            feeds.update({name: host_mask(1, C, p0, t, np.finfo(np.float32).min, np.float32, sliding)
                          for name, sliding in mask_inputs(wanted).items()})
        got = session.run(None, {k: v for k, v in feeds.items() if k in wanted})
        worst = max(worst, float(np.abs(got[0] - want[0]).max()))
        for g, w in zip(got[1:], want[1:]):  # npu: the new rows; others: the cache up to the last written row
            w = w[:, :, p0:p0 + t] if npu else w[:, :, :p0 + t]
            worst = max(worst, float(np.abs(g[:, :, :w.shape[2]] - w).max()))
    return worst


def _attr(node, name):
    return node.attributes[name].value if name in node.attributes else 0


@pytest.mark.parametrize("t", [T, 1])
@pytest.mark.parametrize("target", ["onnx", "ort", "npu"])
def test_rope_computed_from_positions(target, t):
    """Llama: cos/sin = cos/sin(inv_freq @ position_ids), no table; at T=1 cos [1, 1, D] fits both layouts."""
    model, report, step, names = fused("llama", t, target)
    assert report["fuse_rope"]["stats"] == {"fused": 4, "unfused": 0}, report["fuse_rope"]
    ops = collections.Counter(n.op_type for n in model.graph)
    if target == "ort":
        gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == 2 and all(_attr(n, "do_rotary") for n in gqa) and not ops["RotaryEmbedding"], ops
    if target == "npu":
        assert report["lower_npu"]["stats"] == {"attention": 2, "rope": 4, "rmsnorm": 5}, report["lower_npu"]
    err = parity(model, step, names, t, npu=target == "npu")
    print(f"llama T={t} {target}: rope 4/4, max abs {err:.1e}")
    assert err < 1e-4


@pytest.mark.parametrize("target", ["onnx", "ort", "npu"])
def test_interleaved_rope(target):
    """Cohere rotates pairs: stack(-x[..., 1::2], x[..., ::2]).flatten(-2), cos = repeat_interleave(freqs, 2)."""
    model, report, step, names = fused("cohere", T, target)
    assert report["fuse_rope"]["stats"] == {"fused": 4, "unfused": 0}, report["fuse_rope"]
    if target == "onnx":
        ropes = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
        assert len(ropes) == 4 and all(_attr(n, "interleaved") == 1 for n in ropes)
    if target == "ort":
        gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == 2 and all(_attr(n, "do_rotary") and _attr(n, "rotary_interleaved") for n in gqa)
    if target == "npu":
        assert report["lower_npu"]["stats"]["attention"] == 2 and report["lower_npu"]["stats"]["rope"] == 4
    err = parity(model, step, names, T, npu=target == "npu")
    print(f"cohere {target}: interleaved rope 4/4, max abs {err:.1e}")
    assert err < 1e-4


def test_npu_rewrites_opset18_forms():
    """GPT-NeoX (partial rotary, Gelu) exports Split(num_outputs) and Gelu, both opset 18+: lowered to opset 17."""
    model, report, step, names = fused("gpt_neox", T, "npu")
    assert report["lower_npu"]["stats"] == {"attention": 2, "rope": 4}, report["lower_npu"]
    splits = [n for n in model.graph if n.op_type == "Split"]
    assert splits and all("num_outputs" not in n.attributes and len(n.inputs) == 2 for n in splits)
    assert not any(n.op_type == "Gelu" for n in model.graph) and model.opset_imports[""] == 17
    err = parity(model, step, names, T, npu=True)
    print(f"gpt_neox npu: {len(splits)} Split, max abs {err:.1e}")
    assert err < 1e-4


def test_npu_sliding_window_mask():
    """Mistral attends within 4 rows: its layers read the host mask attention_mask.sliding4, not the causal one."""
    model, report, step, names = fused("mistral", T, "npu")
    assert report["lower_npu"]["stats"]["sliding_window"] == 2, report["lower_npu"]
    masks = [v.name for v in model.graph.inputs if v.name.startswith("attention_mask")]
    assert masks == ["attention_mask.sliding4"], masks
    err = parity(model, step, names, T, npu=True)
    print(f"mistral npu: window 4 by host mask, max abs {err:.1e}")
    assert err < 1e-4


def test_sliding_host_mask():
    """Query p0+i sees cache rows and new rows at positions p0+i-W+1 .. p0+i, nothing else."""
    c, p0, t, w = 10, 5, 3, 4
    got = host_mask(1, c, p0, t, -1.0, np.float32, sliding=w)[0, 0] == 0
    column_position = np.concatenate([np.arange(c), p0 + np.arange(t)])
    stored = np.concatenate([np.arange(c) < p0, np.ones(t, bool)])
    query = p0 + np.arange(t)[:, None]
    want = stored & (column_position <= query) & (query - column_position < w)
    assert np.array_equal(got, want)
    assert mask_inputs(["input_ids", "attention_mask", "attention_mask.sliding4"]) == {"attention_mask": 0,
                                                                                        "attention_mask.sliding4": 4}


class _NoCache(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids):
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def test_rope_without_cache_says_why():
    """cos/sin computed from a positions input with no cache: nothing bounds the positions, so no table is made."""
    model = _NoCache(hf_model("llama"))
    args = (torch.zeros(1, T, dtype=torch.int64), torch.arange(T)[None])
    report = {p["pass"]: p for p in run_pipeline(export_module(model, args, ["input_ids", "position_ids"], ["logits"]),
                                                 "onnx")["passes"]}
    assert report["fuse_rope"]["stats"] == {"fused": 0, "unfused": 4}, report["fuse_rope"]
    assert all("no [B, Hkv, C, D] cache input" in n["reason"] for n in report["fuse_rope"]["not_matched"])
    assert report["fuse_attention"]["stats"]["fused"] == 2
