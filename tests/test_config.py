import pytest

from models import ConfigError, preset
from models.config import AttentionConfig


@pytest.mark.parametrize("overrides, field", [
    ({"num_heads": 6, "num_kv_heads": 4}, "num_kv_heads"),
    ({"head_dim": 15}, "head_dim"),
    ({"chunk": 128, "capacity": 64}, "chunk"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_heads": -2}, "num_heads"),
    ({"batch": 1.5}, "batch"),
    ({"capacity": True}, "capacity"),
    ({"rope_theta": 0.0}, "rope_theta"),
    ({"rms_eps": -1e-5}, "rms_eps"),
    ({"dtype": "bf16"}, "dtype"),
    ({"intermediate_size": -1}, "intermediate_size"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"^config field {field}="):
        preset("tiny", **overrides)


def test_unknown_field_and_preset_are_named():
    with pytest.raises(ConfigError, match="unknown config field.*'heads'"):
        preset("tiny", heads=4)
    with pytest.raises(ConfigError, match="unknown preset 'llama'.*minimind"):
        preset("llama")


def test_minimind_preset_is_the_issue_config():
    c = preset("minimind")
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta, c.qk_norm,
            c.capacity, c.chunk, c.batch, c.dtype) == (768, 8, 4, 96, 1e6, True, 2048, 128, 1, "fp32")
    assert c.n_rep == 2 and c.ffn_size == 2432  # MiniMind: 64 * ceil(768 * pi / 64)


def test_config_round_trips_through_dict():
    c = preset("tiny", dtype="fp16", qk_norm=False)
    assert AttentionConfig.from_dict(c.to_dict()) == c
