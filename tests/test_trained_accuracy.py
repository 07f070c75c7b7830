"""The trained model's accuracy table (python -m benchmarks.accuracy --model smollm2), on the tiny chat llama: greedy
tokens counted to the first that differs from transformers' own generate, a first difference at a tie named as such,
the committed prompts through the folder's chat template, the int4 graphs at accuracy level 0, and the table."""
import json

import numpy as np
import onnx
import pytest
import torch

from benchmarks import accuracy as bench, provenance
from benchmarks.report import accuracy_markdown
from export import export_model
from registry import GRID_RULE
from models import build_model, model_config, preset
from runtime import accuracy
from runtime.artifacts import open_generator
from runtime.metrics import distribution
from runtime.text import load_tokenizer

from chat_model import save_chat_model

STEPS = 8


class Eager:
    """transformers' model as a driver: every call a full forward over the ids so far. `fault(logits, call, free)`
    changes the logits of a call (0: the prompt's) of the teacher-forced pass (free False) or the free-running one."""

    def __init__(self, model, fault=None):
        self.model, self.ids, self.fault, self.calls, self.resets = model, None, fault, 0, 0

    def reset(self):
        self.ids, self.calls, self.resets = None, 0, self.resets + 1

    def feed(self, ids):
        ids = torch.from_numpy(np.asarray(ids))
        self.ids = ids if self.ids is None else torch.cat([self.ids, ids], dim=1)
        with torch.no_grad():
            logits = self.model(self.ids).logits[:, -1:].numpy()
        self.calls += 1
        return self.fault(logits, self.calls - 1, self.resets % 2 == 0) if self.fault else logits

    decode = feed


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    tokenizer, model = save_chat_model(folder)
    config = model_config(preset("tiny", capacity=128, chunk=16), "lm", str(folder))
    step = build_model(config, "lm", weights=str(folder))
    prompts = bench.trained_prompts(folder)[:3]
    refs = [tuple(t[0].numpy() for t in step.generate_greedy(torch.from_numpy(p), STEPS + 1)) for p in prompts]
    return folder, config, model, prompts, refs


def _demote(step: int):
    """Logits whose best token at call `step` (0: the prompt's) falls to the bottom: greedy goes another way there."""
    def fault(logits, call, free):
        if call == step:
            logits = logits.copy()
            logits[..., logits.argmax()] = logits.min() - 1
        return logits
    return fault


def test_transformers_itself_matches_every_greedy_token(chat):
    _, _, model, prompts, refs = chat
    r = accuracy.measure(Eager(model), prompts, refs)
    assert r["greedy_tokens"] == [STEPS] * len(prompts) and r["ties"] == [] and r["greedy_match"] == 1
    assert r["top1"] == 1 and r["kl_max"] < 1e-9


@pytest.mark.parametrize("step", [0, 3])
def test_greedy_tokens_stop_at_the_first_difference(chat, step):
    """Planted: greedy goes another way at one step (every prompt). The count stops there; it is no tie."""
    _, _, model, prompts, refs = chat
    r = accuracy.measure(Eager(model, _demote(step)), prompts, refs)
    assert r["greedy_tokens"] == [step] * len(prompts) and r["ties"] == []
    assert r["top1"] == pytest.approx(1 - 1 / (STEPS + 1))


def test_a_first_difference_at_a_tie_is_named(chat):
    """Planted: the reference's runner-up at step 2 of prompt 1 raised to within TIE of its choice, and the driver picks
    it. The count still stops there, and the table names it a tie with its margin."""
    _, _, model, prompts, refs = chat
    tokens, ref = refs[1][0], refs[1][1].copy()
    runner_up = int(np.argsort(ref[2])[-2])
    ref[2, runner_up] = ref[2, tokens[2]] - accuracy.TIE / 2
    tied = [refs[0], (tokens, ref), *refs[2:]]

    def picks_runner_up(logits, call, free):
        if free and call == 2:
            logits = logits.copy()
            logits[..., runner_up] = logits.max() + 1
        return logits
    drivers = iter([Eager(model), Eager(model, picks_runner_up), Eager(model)])
    rows = [accuracy.measure(next(drivers), [p], [r]) for p, r in zip(prompts, tied)]
    assert [r["greedy_tokens"] for r in rows] == [[STEPS], [2], [STEPS]]
    assert rows[1]["ties"] == [{"prompt": 0, "step": 2, "margin": pytest.approx(accuracy.TIE / 2, rel=0.01)}]
    other = accuracy.measure(Eager(model, _demote(2)), prompts[1:2], refs[1:2])
    assert other["greedy_tokens"] == [2] and other["ties"] == []  # the same miss with a real margin is no tie


def test_committed_prompts_go_through_the_chat_template_or_as_text(chat):
    folder = chat[0]
    tokenizer = load_tokenizer(folder)
    entries = json.loads(bench.PROMPTS.read_text())["prompts"]
    ids = bench.trained_prompts(folder)
    assert len(ids) == len(entries) >= 30 and {e["kind"] for e in entries} == {"chat", "prose", "code"}
    opening = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for entry, x in zip(entries, ids):
        assert x.shape[0] == 1
        if entry["kind"] == "chat":
            assert list(x[0, -len(opening):]) == opening and entry["text"] in tokenizer.decode(x[0])
        else:
            assert list(x[0]) == tokenizer(entry["text"])["input_ids"]


def test_int4_at_accuracy_level_0_is_the_same_weights_in_fp32_compute(tmp_path):
    """The level-0 copies of the int4 decode graphs read the same weights file and run fp32 compute (narrower
    weights than the other tests': int4 holds them within its budget)."""
    folder = tmp_path / "hf"
    save_chat_model(folder, initializer_range=0.1)
    config = model_config(preset("tiny", capacity=128, chunk=16), "lm", str(folder))
    prompts = bench.trained_prompts(folder)[:1]
    refs = [tuple(t[0].numpy() for t in build_model(config, "lm", weights=str(folder)).generate_greedy(
        torch.from_numpy(prompts[0]), STEPS + 1))]
    out = tmp_path / "lm"
    export_model(config, out, kind="lm", weights=str(folder), targets=("ort",), quant=("int4",), log=lambda *_: None)
    manifest = bench.level_0(out, "ort-int4")
    decode = [g for g in manifest["graphs"] if g["target"] == "ort-int4" and g.get("quantized")]
    assert decode and all("ort-int4-l0" in g["file"] for g in decode) and bench.LEVEL_0["ort-int4-l0"] == "ort-int4"
    for g in decode:
        copy, original = onnx.load(out / g["file"], load_external_data=False), \
            onnx.load(out / g["file"].replace("ort-int4-l0", "ort-int4"), load_external_data=False)
        levels = lambda m: {a.i for n in m.graph.node if n.op_type == "MatMulNBits"  # noqa: E731
                            for a in n.attribute if a.name == "accuracy_level"}
        assert levels(copy) == {0} and levels(original) == {4}
    level_0 = open_generator(out, "ort-int4", manifest=manifest, provider="cpu")
    level_4 = open_generator(out, "ort-int4", provider="cpu")
    assert accuracy.measure(level_0, prompts, refs)["kl_mean"] < GRID_RULE.cap.kl_mean
    logits = []
    for driver in (level_0, level_4):  # a decode step: prefill keeps fp32 weights
        driver.reset()
        driver.feed(prompts[0])
        logits.append(driver.decode(refs[0][0][:1][None]))
    assert not np.array_equal(logits[0], logits[1])  # another kernel ran: int8 activations at level 4
    assert distribution(logits[0][0], logits[1][0])["top1"].all()


def test_the_trained_table_says_what_was_measured():
    doc = {"model": "smollm2", "reference": "transformers fp32", "decode_steps": 64, "tie": accuracy.TIE,
           "prompts": [{"kind": "chat", "tokens": 20}, {"kind": "code", "tokens": 9}],
           "results": {"ort": {"kl_mean": 1e-9, "kl_max": 2e-9, "top1": 1.0, "greedy_tokens": [64, 64], "ties": []},
                       "ort-int4": {"kl_mean": 0.01, "kl_max": 0.2, "top1": 0.9, "greedy_tokens": [64, 10],
                                    "ties": [{"prompt": 1, "step": 10, "margin": 5e-5}]},
                       "llamacpp-f32": {"unavailable": "pip install failed"}}}
    md = accuracy_markdown(doc)
    assert "2 prompts (benchmarks/prompts.json: 1 chat, 1 code)" in md
    assert "| ort | 1.00e-09 | 2.00e-09 | 100.0% | 64.0 | 2 | none |" in md
    assert "| ort-int4 | 1.00e-02 | 2.00e-01 | 90.0% | 37.0 | 1 | prompt 1 step 10 |" in md
    assert "| llamacpp-f32 | unavailable: pip install failed |" in md


def test_engines_reruns_some_rows_and_keeps_the_others(tmp_path):
    """--engines measures the named engines and keeps every other row of the table there, saying which run made which;
    a table of other prompts, an unknown engine or no table to keep from is refused."""
    row = lambda kl: {"kl_mean": kl, "kl_max": kl, "top1": 1.0, "greedy_tokens": [64], "ties": []}
    base = {"model": "smollm2", "reference": "transformers fp32", "decode_steps": 64, "tie": accuracy.TIE,
            "prompts": [{"kind": "chat", "tokens": 20}]}
    previous = tmp_path / "accuracy.json"
    order = ("ort", "npu-w8a16", "genai-int4")
    with pytest.raises(ValueError, match="does not exist, so there are no other rows to keep"):
        bench._wanted(["npu-w8a16"], order, previous)
    previous.write_text(json.dumps(dict(base, results={"ort": row(1e-9), "npu-w8a16": row(0.5),
                                                       "genai-int4": row(0.3)})))
    with pytest.raises(ValueError, match=r"unknown engine\(s\) \['npu'\]"):
        bench._wanted(["npu"], order, previous)
    assert bench._wanted(["npu-w8a16"], order, previous) == {"npu-w8a16"}
    start = provenance.stamp()
    moved = dict(start, code=dict(start["code"], **{"registry.py": "edited-mid-run"}))  # planted: code changed mid-run
    with pytest.raises(RuntimeError, match=r"the code changed while the run measured \(registry.py\)"):
        bench._kept(dict(base, results={"npu-w8a16": row(0.01)}), previous, order, {"npu-w8a16"}, moved)
    doc = bench._kept(dict(base, results={"npu-w8a16": row(0.01)}), previous, order, {"npu-w8a16"}, start)
    assert list(doc["results"]) == list(order)
    assert doc["results"]["npu-w8a16"]["kl_mean"] == 0.01 and doc["results"]["ort"] == row(1e-9)
    md = accuracy_markdown(doc)
    assert "| npu-w8a16 | 1.00e-02 |" in md and "| genai-int4 | 3.00e-01 |" in md
    stamp = doc["results"]["npu-w8a16"]["measured"]
    assert f"Rows from more than one run (`python -m benchmarks.accuracy --engines`): ort, genai-int4: an earlier " \
           f"run; npu-w8a16: {stamp}." in md
    full = bench._kept(dict(base, results={n: row(0.1) for n in order}), previous, order, set(order), start)  # no note
    assert "more than one run" not in accuracy_markdown(full)
    # a whole run that could not measure an engine (genai not installed) does not carry that engine's old row
    alone = bench._kept(dict(base, results={"ort": row(0.1)}), previous, order, set(order), start)
    assert list(alone["results"]) == ["ort"]
    with pytest.raises(ValueError, match="measured on other prompts"):
        bench._kept(dict(base, prompts=[{"kind": "code", "tokens": 9}], results={"ort": row(0)}), previous, order,
                    {"ort"}, start)


def test_engines_without_a_table_is_refused_before_anything_is_exported(tmp_path, capsys):
    assert bench.main(["--engines", "npu-w8a16", "--out", str(tmp_path)]) == 1
    assert "does not exist, so there are no other rows to keep" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
