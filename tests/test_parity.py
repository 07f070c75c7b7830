"""onnxruntime against eager PyTorch: single steps and whole generated sequences."""
import numpy as np
import pytest
import torch

from runtime.drivers import HostCacheGenerator
from runtime.parity import TOLERANCE, reference_model, sequence_parity, step_case, step_parity, within

CONFIGS = {
    "gqa": {},
    "mha": {"num_kv_heads": 4},
    "mqa-b2": {"num_kv_heads": 1, "batch": 2},
    "no-qk-norm": {"qk_norm": False},
    "fp16": {"dtype": "fp16"},
}


TARGETS = ["raw", "onnx", "ort", "npu"]
STEP_TARGETS = TARGETS[:3]  # the step contract; npu has the host-cache one


def runner(art, step, target):
    """What steps a target: its session, or for `npu` the host-cache driver around it."""
    if target == "npu":
        return art.generator("npu")
    return art.session(step, target)


@pytest.mark.parametrize("kind", ["attention", "block"])
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("target", TARGETS)
def test_step_parity(exported, kind, name, step, target):
    art = exported(kind, **CONFIGS[name])
    model, session, c = art.model(), runner(art, step, target), art.config
    t = c.chunk if step == "prefill" else 1
    for p0 in (0, 7, c.capacity - t):  # empty cache, mid-cache, the last rows
        err = step_parity(step_case(reference_model(model), c, t, p0, seed=p0), session, c)
        print(f"{kind}/{name}/{step}/{target} p0={p0}: max abs {err['max_abs']:.2e}, rel {err['max_rel']:.2e}")
        assert within(err, c.dtype), err
        if c.dtype == "fp32":
            assert err["max_abs"] < TOLERANCE["fp32"]


@pytest.mark.parametrize("kind", ["attention", "block"])
@pytest.mark.parametrize("name", ["gqa", "mha", "mqa-b2", "fp16"])
@pytest.mark.parametrize("target", TARGETS)
def test_sequence_parity(exported, kind, name, target):
    """A prompt longer than one chunk (last chunk padded), then 16 decode steps, against the no-cache forward."""
    art = exported(kind, **CONFIGS[name])
    c = art.config
    gen = art.generator(target)
    if target == "npu":
        assert isinstance(gen, HostCacheGenerator)  # the host owns the cache and the mask
    else:
        assert gen.in_place == (target != "raw")  # fused cache writes share one buffer for past and present
    res = sequence_parity(art.model(), gen, c, prompt_len=c.chunk + 9, decode_steps=16, seed=3)
    print(f"{kind}/{name}/{target}: sequence max abs {res['max_abs']:.2e}, worst at position {res['worst_position']}")
    assert within(res, c.dtype), res


@pytest.mark.parametrize("target", TARGETS)
def test_sequence_parity_when_the_last_chunk_would_overrun_the_cache(exported, target):
    """C=40, T=16: a 38-token prompt cannot pad its third chunk to 48 rows; its tail decodes instead."""
    art = exported(capacity=40)
    res = sequence_parity(art.model(), art.generator(target), art.config, prompt_len=38, decode_steps=2, seed=4)
    assert within(res, "fp32"), res
    gen = art.generator()
    gen.prefill(np.zeros((1, 38, 64), np.float32))
    assert gen.position == 38


def test_sequence_parity_fails_on_a_broken_cache(exported):
    """The check can fail: a generator whose cache loses its rows between steps is caught."""
    art = exported()
    gen = art.generator()
    step = gen._step

    def forgetful(session, x, p0):
        out = step(session, x, p0)
        gen._past, gen._present = gen._present, gen._past  # undo the swap: the next step reads a stale cache
        return out

    gen._step = forgetful
    res = sequence_parity(art.model(), gen, art.config, prompt_len=20, decode_steps=4)
    assert not within(res, "fp32")


@pytest.mark.parametrize("target", STEP_TARGETS)
def test_causality_rows_beyond_the_position_change_nothing(exported, target):
    art = exported()
    c, session = art.config, art.session("prefill", target)
    rng = np.random.default_rng(0)
    p0 = 20
    feeds = {"hidden_states": rng.standard_normal((1, c.chunk, c.hidden_size), np.float32),
             "position_ids": np.arange(p0, p0 + c.chunk)[None],
             "past_key": rng.standard_normal((1, c.num_kv_heads, c.capacity, c.head_dim), np.float32),
             "past_value": rng.standard_normal((1, c.num_kv_heads, c.capacity, c.head_dim), np.float32)}
    base = session.run(feeds)["output"]
    future = {**feeds, "past_key": feeds["past_key"].copy(), "past_value": feeds["past_value"].copy()}
    future["past_key"][:, :, p0 + c.chunk:] = 1e4 * rng.standard_normal((1, c.num_kv_heads, c.capacity - p0 - c.chunk, c.head_dim))
    future["past_value"][:, :, p0 + c.chunk:] = -7e3
    assert np.array_equal(session.run(future)["output"], base)
    past = {**feeds, "past_value": feeds["past_value"].copy()}
    past["past_value"][:, :, p0 - 1] += 5.0  # a row every query sees
    assert np.abs(session.run(past)["output"] - base).max() > 1e-2


def test_npu_causality_stale_rows_change_nothing(exported):
    """The host's mask hides cache rows at and after p0. It is additive and finite (fp16-safe), so it hides
    rows whose scores stay far below |MASK_VALUE| = 3e4: any real K row (here 10x a unit K) qualifies."""
    gen = exported().generator("npu")
    keys, values = gen.caches["past_key"], gen.caches["past_value"]
    x = np.random.default_rng(1).standard_normal((1, gen.chunk, *gen.features)).astype(np.float32)
    keys[...] = np.random.default_rng(2).standard_normal(keys.shape)
    values[...] = np.random.default_rng(3).standard_normal(values.shape)
    base = gen.run_step("prefill", x, 20)
    stale = np.random.default_rng(4).standard_normal(keys[:, :, 20:].shape)
    keys[:, :, 20:], values[:, :, 20:] = 10 * stale, -3e4
    assert np.array_equal(gen.run_step("prefill", x, 20), base)
    values[:, :, 19] += 5.0  # a row every query sees
    assert np.abs(gen.run_step("prefill", x, 20) - base).max() > 1e-2


@pytest.mark.parametrize("target", STEP_TARGETS)
def test_sdpa_switch_gives_the_same_graph_outputs(exported, target):
    plain, sdpa = exported(), exported(sdpa=True)
    for step, t in (("prefill", plain.config.chunk), ("decode", 1)):
        from models.contract import example_inputs
        args = example_inputs(plain.config, t, p0=9, seed=5)
        feeds = dict(zip(("hidden_states", "position_ids", "past_key", "past_value"), (a.numpy() for a in args)))
        a, b = plain.session(step, target).run(feeds), sdpa.session(step, target).run(feeds)
        with torch.no_grad():
            ref = plain.model()(*args)[0].numpy()
        assert np.abs(a["output"] - b["output"]).max() < 1e-5
        assert np.abs(b["output"] - ref).max() < 1e-4
