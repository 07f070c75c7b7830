"""GLM (transformers' model_type "glm": partial rotary on half the head dim, interleaved pairs, q/k/v biases) as the
whole model, and which reference our greedy tokens are held to.

The held-out GLM checkpoint seemed to diverge from transformers' cached `generate` on every target, raw included. It
did not: its greedy token after the prompt below is its eos (id 2, logit 11.0 against 9.06), and the reference was
`generate(..., min_new_tokens=10)`, whose MinNewTokensLengthLogitsProcessor sets the eos logit to -inf for the first 10
new tokens, so transformers returned the greedy path *with eos forbidden*. Transformers' cached and uncached forwards
agree (the same greedy tokens; logits within 4e-5), and so do our eager step and our graphs. The reference that
forces 10 tokens without changing any of them is `generate(..., eos_token_id=None)`: no stop, no suppression.

This checkpoint is the held-out one (the same config and seed give the same weights), small enough to export in the
test; its greedy path runs through eos twice, so a reference that suppresses eos fails here."""
import pytest
import torch

from export import export_model
from models import preset
from models.hf_step import HFStep
from runtime import open_generator
from runtime.generate import generate

EOS = 2
CONFIG = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False,
              initializer_range=0.5,  # large weights: greedy tokens are not near ties
              pad_token_id=0, bos_token_id=1, eos_token_id=EOS)  # glm's defaults (151329, ...) lie outside 128 ids
PROMPT = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(5))
NEW = 10
CAPACITY, CHUNK = 32, 8
TARGETS = ("raw", "ort")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers
    config = transformers.AutoConfig.for_model("glm", **CONFIG)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5  # rotary on half the head dim, as GLM is
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("glm")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model(folder):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def reference(model, **kwargs):
    """transformers' own (cached) greedy generate: NEW tokens after PROMPT."""
    with torch.no_grad():
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW, do_sample=False,
                             **kwargs)
    return out[0, PROMPT.shape[1]:].tolist()


@pytest.fixture(scope="module")
def want(model):
    """Greedy tokens with nothing stopping or suppressing eos: generate told there is no eos."""
    got = reference(model, eos_token_id=None)
    assert len(got) == NEW
    return got


def test_transformers_cached_equals_uncached_and_eos_is_on_the_greedy_path(model, want):
    """The reference is sound (cached generate == uncached generate == argmax of the full forward, token by token),
    and min_new_tokens is not: it forbids eos, which is this checkpoint's greedy token twice."""
    assert reference(model, eos_token_id=None, use_cache=False) == want
    ids = PROMPT.clone()
    with torch.no_grad():
        for token in want:
            assert model(ids, use_cache=False).logits[0, -1].argmax().item() == token
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    assert want.count(EOS) == 2 and want[0] == EOS, want
    suppressed = reference(model, min_new_tokens=NEW)  # the old reference: a different sequence, with no eos at all
    assert EOS not in suppressed and suppressed != want
    assert reference(model) == [EOS]  # the checkpoint's own generation config stops at eos


def test_eager_step_equals_generate(model, want):
    """HFStep in eager PyTorch (no ONNX): the prompt in chunks of CHUNK over a CAPACITY-row cache, then decode steps;
    every greedy token is generate's, every step's logits the full forward's."""
    step = HFStep(model)
    cfg = model.config
    past = [torch.zeros(1, cfg.num_key_value_heads, CAPACITY, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    ids, got = PROMPT[0].tolist(), []
    with torch.no_grad():
        for start in range(0, len(ids), CHUNK):  # chunks of 8 then 4: the last row of each step is real
            chunk = torch.tensor([ids[start:start + CHUNK]])
            logits, *past = step(chunk, torch.arange(start, start + chunk.shape[1])[None], *past)
        while len(got) < NEW:
            full = step.forward_full(torch.tensor([ids]))[0, -1]
            torch.testing.assert_close(logits[0, -1], full, rtol=0, atol=1e-4)
            got.append(logits[0, -1].argmax().item())
            ids.append(got[-1])
            logits, *past = step(torch.tensor([[got[-1]]]), torch.tensor([[len(ids) - 1]]), *past)
    assert got == want


@pytest.fixture(scope="module")
def exported(folder, tmp_path_factory):
    """(folder, manifest): raw and ort exported and checked once (two targets, not four: test time)."""
    out = tmp_path_factory.mktemp("glm-lm")
    config = preset("tiny", capacity=CAPACITY, chunk=CHUNK, source="transformers")
    return out, export_model(config, out, kind="lm", weights=str(folder), targets=TARGETS, windows=(CAPACITY,),
                             log=lambda *_: None)


@pytest.mark.parametrize("target", TARGETS)
def test_exported_greedy_equals_generate(exported, model, want, target):
    """The exported graphs (raw as torch.onnx wrote it; ort with both layers' attention and the partial interleaved
    rotary fused) through the runtime: the same tokens as generate, eos included, and with eos as the stop token the
    same stop as generate with the checkpoint's own config."""
    out, manifest = exported
    for g in manifest["graphs"]:
        if g["target"] == target:
            assert g["attention_fused"] == ("0/2" if target == "raw" else "2/2"), g["file"]
    assert manifest["sequence_parity"]["targets"][target]["top1_agreement"] == 1.0
    assert generate(open_generator(out, target, provider="cpu"), PROMPT[0].tolist(), NEW)["generated_ids"] == want
    stopped = generate(open_generator(out, target, provider="cpu"), PROMPT[0].tolist(), NEW, eos=(EOS,))
    assert stopped["generated_ids"] == reference(model) == [EOS] and stopped["stop"] == "eos"
