"""Any Hugging Face decoder-only LM as the whole model (issue 20): tiny random checkpoints that transformers' own
save_pretrained writes, exported by `export_model(kind="lm", weights=FOLDER)` from transformers' modeling code
(models/hf_step.py) over a window ladder of 16 and 32 rows; every layer's attention fused on onnx and ort and lowered
on npu (the exporter's own check), and greedy tokens through the runtime equal to transformers' own `generate`. Folders outside
the scope (encoder-decoder, state-space, hybrid, mixture of experts, multimodal) are refused in one line."""
import json

import numpy as np
import pytest
import torch

from export import export_model
from models import build_model, model_config, preset
from models.checkpoint import config_from_folder
from models.hf_step import HFStep
from models.weights import WeightsError
from runtime import open_generator
from runtime.generate import generate

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"]
TARGETS = ["raw", "onnx", "ort", "npu"]
LADDER = (16, 32)
SLIDING = ("mistral", "gemma2", "gemma3_text")  # exported over the ladder (the others over 32 rows alone: test time)
WINDOW = 4  # the sliding window of mistral, gemma2 and gemma3_text: much shorter than the prompts below
# Which layers are local: Mistral's all; Gemma 2's even layers by its default layer_types, Gemma 3's as set below.
LOCAL = {"mistral": [WINDOW, WINDOW], "gemma2": [WINDOW, None], "gemma3_text": [WINDOW, None]}
COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False,
              initializer_range=0.5)  # large weights: greedy tokens are not near ties
EXTRA = {
    "mistral": dict(sliding_window=WINDOW),
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(head_dim=None, sliding_window=None, pad_token_id=0),
}


def hf_config(family, **extra):
    import transformers
    kwargs = {k: v for k, v in (COMMON | EXTRA.get(family, {}) | extra).items() if v is not None}
    return transformers.AutoConfig.for_model(family, **kwargs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(family) -> a tiny random checkpoint saved by save_pretrained (made once)."""
    import transformers
    made = {}

    def get(family):
        if family not in made:
            torch.manual_seed(0)
            made[family] = tmp_path_factory.mktemp(family)
            transformers.AutoModelForCausalLM.from_config(hf_config(family)).save_pretrained(made[family])
        return made[family]
    return get


def ladder(family):
    return LADDER if family in SLIDING else LADDER[-1:]


@pytest.fixture(scope="module")
def exported(folder, tmp_path_factory):
    """exported(family) -> (folder, manifest): every target (over the ladder for the sliding families), exported and
    checked once."""
    done = {}

    def get(family):
        if family not in done:
            out = tmp_path_factory.mktemp(f"{family}-lm")
            config = preset("tiny", capacity=32, chunk=8, source="transformers")
            done[family] = out, export_model(config, out, kind="lm", weights=str(folder(family)),
                                             targets=tuple(TARGETS), windows=ladder(family), log=lambda *_: None)
        return done[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_fuses_and_tokens_match_eager(exported, family):
    out, manifest = exported(family)
    assert manifest["config"]["source"] == "transformers"
    for g in manifest["graphs"]:
        assert g["attention_fused"] == ("0/2" if g["target"] == "raw" else "2/2"), g["file"]
    for target in TARGETS:
        seq = manifest["sequence_parity"]["targets"][target]
        runs_over = list(ladder(family))[-1:] if target == "ort" else list(ladder(family))  # GQA: the capacity alone
        assert seq["top1_agreement"] == 1.0 and seq["windows"] == runs_over, (target, seq)
    local = LOCAL.get(family, [None, None])  # the manifest says which layers attend within a window
    assert manifest["lm"]["attention"]["windows"] == local, manifest["lm"]["attention"]
    assert manifest["lm"]["attention"]["local_layers"] == [i for i, w in enumerate(local) if w]
    print(family, {t: f"{s['max_rel']:.1e}" for t, s in manifest["sequence_parity"]["targets"].items()})


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(exported, folder, family, target):
    """A 12-token prompt (three sliding windows long) and 10 greedy tokens (the sliding families' runtime switches
    from the 16-row graphs to the 32-row ones on the way): every token is the one transformers' own generate picks,
    eos not special to either (min_new_tokens would forbid eos instead, and so change the reference: test_hf_glm)."""
    import transformers
    out, _ = exported(family)
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder(family)).eval()
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, eos_token_id=None,
                          do_sample=False)[0, 12:].tolist()
    gen = open_generator(out, target, provider="cpu")
    got = generate(gen, prompt[0].tolist(), max_new_tokens=10)["generated_ids"]
    assert got == want, (family, target, got, want)


def test_a_qwen3_folder_is_the_course_model_unless_told(folder):
    base = preset("tiny", capacity=32, chunk=8)
    assert config_from_folder(folder("qwen3"), base).source == "course"
    assert config_from_folder(folder("qwen3"), base.replace(source="transformers")).source == "transformers"
    assert config_from_folder(folder("llama"), base).source == "transformers"
    with pytest.raises(WeightsError, match="the course model reads qwen3, minimind.*--source transformers"):
        config_from_folder(folder("llama"), base.replace(source="course"))


def test_dims_come_from_the_config(folder):
    config = model_config(preset("tiny"), "lm", str(folder("phi3")))
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers,
            config.vocab_size, config.tie_embeddings) == (64, 4, 2, 16, 2, 128, False)


def test_batch_rows_at_different_positions(folder):
    """Masks come from position_ids, row by row: a batch of two rows at different positions (one inside the
    sliding window's band, one past it) gives each row what it gives alone."""
    config = model_config(preset("tiny", capacity=32, chunk=8), "lm", str(folder("gemma3_text")))
    step = build_model(config, "lm", weights=str(folder("gemma3_text")))
    assert isinstance(step, HFStep)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 8), generator=g)
    pos = torch.stack([torch.arange(3, 11), torch.arange(17, 25)])
    caches = [torch.randn(2, 2, 32, 16, generator=g) for _ in range(4)]
    with torch.no_grad():
        both = step(ids, pos, *caches)
        for b in range(2):
            alone = step(ids[b:b + 1], pos[b:b + 1], *[c[b:b + 1] for c in caches])
            for x, y in zip(both, alone):
                np.testing.assert_allclose(x[b:b + 1].numpy(), y.numpy(), rtol=1e-5, atol=1e-5)


REFUSED = {
    "t5": "encoder-decoder",
    "bart": "encoder-decoder",
    "mamba": "without attention heads",
    "rwkv": "without attention heads",
    "recurrent_gemma": "hybrid with linear_attention layers",
    "jamba": "hybrid with linear_attention layers",
    "mixtral": "mixture of experts (num_experts=8)",
    "qwen2_moe": "mixture of experts (num_experts=60)",
    "gemma3": "multimodal (vision_config",
    "llava": "multimodal",
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_what_does_not_fit_is_refused_in_one_line(tmp_path, family):
    import transformers
    transformers.AutoConfig.for_model(family).save_pretrained(tmp_path)
    with pytest.raises(WeightsError) as e:
        config_from_folder(tmp_path, preset("tiny"))
    message = str(e.value)
    assert "\n" not in message and REFUSED[family] in message, message
    assert "expected a decoder-only causal LM with softmax attention" in message


def test_an_unknown_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nosuchlm", "architectures": ["NoSuchLM"]}))
    with pytest.raises(WeightsError, match="model_type 'nosuchlm': transformers .* cannot build its config"):
        config_from_folder(tmp_path, preset("tiny"))
