"""MiniMind-format state dicts: loaded exactly, or refused with every key that does not fit."""
import numpy as np
import pytest
import torch

from export import export_model
from models import WeightsError, build_model, preset
from models.contract import example_inputs
from runtime import open_step

CONFIG = preset("tiny")


def minimind_checkpoint(path, layers=2):
    """A full checkpoint as MiniMind saves it: every layer under model.layers.N., plus embeddings."""
    state = {"model.embed_tokens.weight": torch.randn(10, 64), "model.norm.weight": torch.ones(64)}
    for n in range(layers):
        block = build_model(CONFIG, "block", seed=100 + n)
        state |= {f"model.layers.{n}.{k}": v for k, v in block.state_dict().items()}
    torch.save(state, path)
    return state


def test_attention_and_block_from_a_full_checkpoint(tmp_path):
    state = minimind_checkpoint(tmp_path / "full.pth")
    attn = build_model(CONFIG, "attention", weights=tmp_path / "full.pth", layer=1)
    assert torch.equal(attn.k_norm.weight, state["model.layers.1.self_attn.k_norm.weight"])
    block = build_model(CONFIG, "block", weights=tmp_path / "full.pth", layer=0)
    assert torch.equal(block.mlp.down_proj.weight, state["model.layers.0.mlp.down_proj.weight"])


def test_exported_graph_computes_with_the_loaded_weights(tmp_path):
    minimind_checkpoint(tmp_path / "full.pth")
    export_model(CONFIG, tmp_path / "out", weights=str(tmp_path / "full.pth"), layer=1, log=lambda *_: None)
    args = example_inputs(CONFIG, 1, p0=3)
    got = open_step(tmp_path / "out", "decode").run(dict(zip(("hidden_states", "position_ids", "past_key", "past_value"),
                                                             (a.numpy() for a in args))))
    with torch.no_grad():
        want = build_model(CONFIG, "attention", weights=tmp_path / "full.pth", layer=1)(*args)[0].numpy()
        random = build_model(CONFIG, "attention")(*args)[0].numpy()
    assert np.abs(got["output"] - want).max() < 1e-5 and np.abs(got["output"] - random).max() > 1e-2


def test_plain_state_dict_round_trips(tmp_path):
    src = build_model(CONFIG, "attention", seed=7)
    torch.save(src.state_dict(), tmp_path / "attn.pt")
    dst = build_model(CONFIG, "attention", weights=tmp_path / "attn.pt")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("k_norm.weight"), r"missing keys \['k_norm.weight'\]"),
    (lambda s: s.update({"q_proj.bias": torch.zeros(64)}), r"unexpected keys \['q_proj.bias'\]"),
    (lambda s: s.update({"o_proj.weight": torch.zeros(64, 32)}), r"o_proj.weight \(64, 32\) \(expected \(64, 64\)\)"),
])
def test_keys_that_do_not_fit(tmp_path, edit, message):
    state = build_model(CONFIG).state_dict()
    edit(state)
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(WeightsError, match=message):
        build_model(CONFIG, weights=tmp_path / "w.pt")


def test_qk_norm_off_refuses_norm_weights(tmp_path):
    torch.save(build_model(CONFIG).state_dict(), tmp_path / "w.pt")
    with pytest.raises(WeightsError, match=r"unexpected keys \['k_norm.weight', 'q_norm.weight'\]"):
        build_model(CONFIG.replace(qk_norm=False), weights=tmp_path / "w.pt")


def test_corrupt_and_truncated_files(tmp_path):
    torch.save(build_model(CONFIG).state_dict(), tmp_path / "w.pt")
    data = (tmp_path / "w.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"\x00not a checkpoint" * 10)
    (tmp_path / "empty.pt").write_bytes(b"")
    for name in ("truncated.pt", "garbage.pt", "empty.pt"):
        with pytest.raises(WeightsError, match=f"{name}: cannot be read as a torch state dict"):
            build_model(CONFIG, weights=tmp_path / name)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(WeightsError, match="expected a dict of tensors"):
        build_model(CONFIG, weights=tmp_path / "list.pt")


def test_layer_selection_errors(tmp_path):
    minimind_checkpoint(tmp_path / "full.pth")
    with pytest.raises(WeightsError, match=r"layers \[0, 1\]; expected --layer N"):
        build_model(CONFIG, weights=tmp_path / "full.pth")
    with pytest.raises(WeightsError, match=r"no layer 5; expected one of \[0, 1\]"):
        build_model(CONFIG, weights=tmp_path / "full.pth", layer=5)
    torch.save(build_model(CONFIG).state_dict(), tmp_path / "attn.pt")
    with pytest.raises(WeightsError, match="--layer 0 given, but the file has no 'model.layers.N.' keys"):
        build_model(CONFIG, weights=tmp_path / "attn.pt", layer=0)
