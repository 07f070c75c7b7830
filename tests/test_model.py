"""The eager model itself: the cached step agrees with the course's whole-sequence forward."""
import pytest
import torch

from models import build_model, preset
from models.attention import repeat_kv
from models.contract import example_inputs


def run_cached(model, config, x, chunk_lens):
    cache = torch.zeros(config.batch, config.num_kv_heads, config.capacity, config.head_dim, dtype=x.dtype)
    k, v, outs, p = cache, cache.clone(), [], 0
    for n in chunk_lens:
        pos = (p + torch.arange(n)).expand(config.batch, n)
        out, k, v = model(x[:, p:p + n], pos, k, v)
        outs.append(out)
        p += n
    return torch.cat(outs, dim=1), k, v


@pytest.mark.parametrize("kind", ["attention", "block"])
@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_cached_steps_match_full_forward(kind, sdpa, kv_heads):
    config = preset("tiny", num_kv_heads=kv_heads, sdpa=sdpa, batch=2)
    model = build_model(config, kind)
    x = torch.randn(2, 30, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.forward_full(x)
        cached, _, _ = run_cached(model, config, x, [16, 5, 1, 1, 7])
    assert (cached - full).abs().max() < 1e-5


def test_repeat_kv_repeats_each_head_for_consecutive_query_heads():
    x = torch.arange(3.0).view(1, 1, 3, 1)  # three KV heads holding 0, 1, 2
    assert repeat_kv(x, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2]


def test_cache_holds_rotated_keys_and_raw_values_at_their_positions():
    config = preset("tiny")
    model = build_model(config)
    x, pos, k0, v0 = example_inputs(config, config.chunk, p0=5)
    with torch.no_grad():
        _, k, v = model(x, pos, k0, v0)
        xv = model.v_proj(x).view(1, config.chunk, config.num_kv_heads, config.head_dim).transpose(1, 2)
        xk = model.k_proj(x).view(1, config.chunk, config.num_kv_heads, config.head_dim).transpose(1, 2)
    rows = slice(5, 5 + config.chunk)
    assert torch.equal(v[:, :, rows], xv)                                 # V: no norm, no RoPE
    assert not torch.allclose(k[:, :, rows], xk, atol=1e-3)               # K: normed and rotated
    assert torch.equal(k[:, :, :5], k0[:, :, :5]) and torch.equal(v[:, :, 21:], v0[:, :, 21:])  # other rows kept


def test_fp16_model_stays_in_fp16():
    config = preset("tiny", dtype="fp16")
    out, k, v = build_model(config)(*example_inputs(config, 4, p0=3))
    assert out.dtype == k.dtype == v.dtype == torch.float16
