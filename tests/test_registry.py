"""Targets and schemes are defined once, in registry.py: the source names none of them elsewhere, and a target added
there alone reaches the CLIs, the export's manifest and checks, generation and the report."""
import ast
import json
from pathlib import Path

import pytest

import registry
from benchmarks.report import accuracy_markdown
from export import export_model
from models import preset
from passes.__main__ import main as passes_main
from runtime.generate import main as generate_main

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("models", "runtime", "passes", "export", "benchmarks")
# Names the benchmarks compare with a peer's own build of the same bits: onnxruntime-genai's `int4` precision, the
# int4 export-cost variant and the README's int4-against-peers block. Each names the peer's figure it sits beside.
PEER_COMPARISONS = {("benchmarks/peers.py", "int4"), ("benchmarks/scale.py", "int4"), ("benchmarks/report.py", "int4"),
                    ("benchmarks/report.py", "ort-int4")}


def named_targets(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each string constant in `path` that is a target's or scheme's name, docstrings aside."""
    names = set(registry.TARGETS) | set(registry.schemes())
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in docs]


def test_no_source_file_but_the_registry_names_a_target():
    found = [f"{p.relative_to(ROOT)}:{line}: {name!r}" for d in SOURCE for p in sorted((ROOT / d).rglob("*.py"))
             for line, name in named_targets(p) if (str(p.relative_to(ROOT)), name) not in PEER_COMPARISONS]
    assert not found, "define targets and schemes in registry.py alone: " + "; ".join(found)


def test_the_scan_finds_a_planted_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""npu in a docstring is prose."""\nTARGETS = ("raw", "onnx")\nif target == "npu-w8a16":\n    pass\n')
    assert named_targets(planted) == [(2, "raw"), (2, "onnx"), (3, "npu-w8a16")]


@pytest.fixture
def dummy(monkeypatch):
    """A target added through the registry alone: ort's graphs under another name, no passes of its own."""
    entry = registry.Target("ort-dummy", "ort", lambda fix_dims: [], "ort's graphs, renamed (a test's)",
                            lint="contrib", contrib=True, in_place=True)
    monkeypatch.setitem(registry.TARGETS, entry.name, entry)
    return entry.name


def test_a_target_added_to_the_registry_alone_runs_everywhere(dummy, tmp_path, capsys):
    out = tmp_path / "lm"
    config = preset("tiny")
    manifest = export_model(config, out, kind="lm", targets=("ort", dummy), log=lambda *_: None)
    made = [g for g in manifest["graphs"] if g["target"] == dummy]
    assert [g["step"] for g in made] == ["prefill", "decode"] and all(g["parity"]["max_rel"] < 1e-4 for g in made)
    assert json.loads((out / "manifest.json").read_text())["sequence_parity"]["targets"][dummy]["max_rel"] < 1e-4
    raw = next(g["file"] for g in manifest["graphs"] if g["target"] == "ort" and g["step"] == "decode")
    assert passes_main([str(out / raw), str(tmp_path / "again.onnx"), "--target", dummy]) == 0
    assert generate_main([str(out), "--target", dummy, "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                          "--json"]) == 0
    ids = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generated_ids"]
    assert generate_main([str(out), "--target", "ort", "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                          "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generated_ids"] == ids
    doc = {"preset": "tiny", "reference": "eager", "prompts": [3], "decode_steps": 1,
           "results": {dummy: {k: 0.0 for k in ("max_rel", "mean_rel", "kl_mean", "kl_max", "greedy_match")}
                       | {"top1": 1.0}}}
    assert f"| {dummy} |" in accuracy_markdown(doc)


def test_an_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown target 'tpu': expected one of raw, onnx, ort, npu"):
        registry.target("tpu")
