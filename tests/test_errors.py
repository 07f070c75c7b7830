"""Bad input: one clear line naming what was wrong and what was expected; nothing half-written."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from export.atomic import OutputError
from export import export_model
from models import preset
from runtime import ArtifactError, FeedError, open_step

ROOT = Path(__file__).resolve().parents[1]


def good_feeds(c, t, p0=0):
    cache = np.zeros((c.batch, c.num_kv_heads, c.capacity, c.head_dim), np.float32)
    return {"hidden_states": np.zeros((c.batch, t, c.hidden_size), np.float32),
            "position_ids": np.arange(p0, p0 + t)[None].repeat(c.batch, 0),
            "past_key": cache, "past_value": cache.copy()}


@pytest.mark.parametrize("change, message", [
    (lambda f: f.pop("past_value"), r"feeds: missing \['past_value'\]"),
    (lambda f: f.update(extra=np.zeros(1)), r"unexpected \['extra'\]"),
    (lambda f: f.update(hidden_states=f["hidden_states"][:, :3]), r"hidden_states: shape \[1, 3, 64\]; expected \[1, 16, 64\]"),
    (lambda f: f.update(hidden_states=f["hidden_states"].astype(np.float64)), "hidden_states: dtype float64; expected float32"),
    (lambda f: f.update(position_ids=f["position_ids"].astype(np.int32)), "position_ids: dtype int32; expected int64"),
    (lambda f: f.update(past_key=f["past_key"][:, :1]), r"past_key: shape \[1, 1, 64, 16\]"),
    (lambda f: f.update(position_ids=f["position_ids"] + 50), "position_ids: max 65 is past the cache; expected positions < capacity 64"),
    (lambda f: f.update(position_ids=f["position_ids"] - 1), "position_ids: min -1"),
    (lambda f: f.update(position_ids=f["position_ids"][:, ::-1].copy()), "expected consecutive positions"),
    (lambda f: f.update(hidden_states=[[0.0]]), "hidden_states: a list; expected a numpy array"),
])
def test_wrong_feeds(exported, change, message):
    art = exported()
    feeds = good_feeds(art.config, 16)
    change(feeds)
    with pytest.raises(FeedError, match=message):
        art.session("prefill").run(feeds)


def test_generator_refuses_what_does_not_fit(exported):
    gen = exported().generator()
    with pytest.raises(FeedError, match=r"prompt: shape \[1, 5\]; expected \[1, L, 64\]"):
        gen.prefill(np.zeros((1, 5), np.float32))
    with pytest.raises(FeedError, match="prompt: length 65 at position 0; expected 1..64"):
        gen.prefill(np.zeros((1, 65, 64), np.float32))
    gen.prefill(np.zeros((1, 64, 64), np.float32))
    with pytest.raises(FeedError, match="decode: position 64 is past the cache"):
        gen.decode(np.zeros((1, 1, 64), np.float32))
    with pytest.raises(FeedError, match=r"prefill at position 60: rows 60..75; expected them inside the cache \(0..63\)"):
        gen.run_step("prefill", np.zeros((1, 16, 64), np.float32), 60)
    gen.reset()
    with pytest.raises(FeedError, match="hidden_states: dtype float16; expected float32"):
        gen.decode(np.zeros((1, 1, 64), np.float16))


def test_missing_manifest_or_graph(exported, tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json: not found"):
        open_step(tmp_path, "decode")
    (tmp_path / "manifest.json").write_text("{ truncated")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        open_step(tmp_path, "decode")
    with pytest.raises(ArtifactError, match=r"no decode graph for target 'tpu'.*decode/ort"):
        open_step(exported().folder, "decode", target="tpu")


def test_unknown_provider_and_opt_level(exported):
    art = exported()
    with pytest.raises(ValueError, match="unknown provider 'tpu'"):
        open_step(art.folder, "decode", provider="tpu")
    with pytest.raises(ValueError, match="unknown graph optimisation level 'max'"):
        art.session("decode", opt_level="max")


def test_output_folder_that_cannot_be_written(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("not a folder")
        target = blocker / "out"  # a folder under a regular file: unwritable even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        target = ro / "out"
    with pytest.raises(OutputError, match="cannot be written"):
        export_model(preset("tiny"), target, log=lambda *_: None)


@pytest.mark.parametrize("args, message", [
    (["--heads", "6", "--kv-heads", "4"], "error: config field num_kv_heads=4: expected a divisor of num_heads=6"),
    (["--head-dim", "15"], "error: config field head_dim=15: expected an even number"),
    (["--chunk", "4096"], "error: config field chunk=4096: expected at most capacity=64"),
    (["--weights", "/nonexistent.pt"], "error: weights file /nonexistent.pt: not found"),
])
def test_cli_errors_are_one_line(args, message, tmp_path, capsys):
    status, err = cli("export", ["--preset", "tiny", "--out", str(tmp_path / "o"), *args], capsys)
    assert status == 1
    assert err.strip() == err.strip().splitlines()[0] and err.startswith(message), err
    assert not (tmp_path / "o").exists()


def cli(module: str, argv: list[str], capsys) -> tuple[int, str]:
    """`python -m module argv` in this process (what the subprocess tests below do once end to end):
    (exit status, stderr)."""
    import importlib
    plain = ("passes.lint", "runtime.verify", "runtime.generate", "export.handoff")  # modules that are their own CLI
    entry = importlib.import_module(module if module in plain else f"{module}.__main__")
    try:
        status = entry.main(argv)
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    return status, capsys.readouterr().err


def test_killed_export_leaves_the_old_folder_whole(tmp_path):
    """SIGKILL mid-export: the previous export stays as it was; the orphaned staging folder goes next time."""
    import hashlib
    import signal
    import time

    out = tmp_path / "out"
    export_model(preset("tiny"), out, log=lambda *_: None)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    proc = subprocess.Popen([sys.executable, "-m", "export", "--preset", "tiny", "--seed", "7", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.staging-*/*")) and time.time() < deadline:  # mid-write: files are being staged
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before
    assert list(tmp_path.glob(".out.staging-*"))  # what the kill left behind, hidden
    export_model(preset("tiny"), out, targets=("raw",), log=lambda *_: None)
    assert not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("argv, message", [
    (["export", "--preset", "nope"], "error: argument --preset: invalid choice: 'nope'"),
    (["export", "--heads", "two"], "error: argument --heads: invalid int value: 'two'"),
    (["passes", "a.onnx", "b.onnx", "--target", "tpu"], "error: argument --target: invalid choice: 'tpu'"),
    (["passes.lint", "a.onnx", "--profile", "qnn"], "error: argument --profile: unknown profile 'qnn'"),
    (["runtime.verify"], "error: the following arguments are required: bundle"),
    (["export.handoff", "--kinds", "mlp"], "error: argument --kinds: invalid choice: 'mlp'"),
    (["runtime.generate", "x", "--prompt-ids", "1", "--target", "tpu"], "error: argument --target: invalid choice"),
])
def test_usage_errors_are_one_line(argv, message, capsys):
    status, err = cli(argv[0], argv[1:], capsys)
    assert status == 2 and err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, status, message", [
    (["export", "--preset", "nope"], 2, "error: argument --preset: invalid choice: 'nope'"),
    (["export", "--preset", "tiny", "--weights", "/nonexistent.pt"], 1, "error: weights file /nonexistent.pt: not found"),
])
def test_python_m_entry_points(argv, status, message, tmp_path):
    """The same, end to end as a user runs it."""
    res = subprocess.run([sys.executable, "-m", *argv, "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == status and res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr
