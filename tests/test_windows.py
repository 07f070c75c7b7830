"""The window ladder: graphs over 16, 32 and 64 (= C) cache rows, and drivers that switch between them."""
import gc
import json
import weakref
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from export.__main__ import main as export_main  # python -m export's (test_export.py runs the command itself)
from export.windows import WindowError, default, parse
from models import preset
import runtime.artifacts
from runtime.artifacts import load_manifest, open_step, reads_live_rows_only
from runtime.parity import sequence_parity, token_parity, within
from conftest import prepacks

ROOT = Path(__file__).resolve().parents[1]
LADDER = (16, 32, 64)
TARGETS = ["raw", "onnx", "ort", "npu"]
# the targets that run over the ladder; the ort target's GroupQueryAttention reads only the rows in use, so it runs over
# the capacity's graphs alone
SWITCHING = ["raw", "onnx", "npu"]


def recording(gen):
    """The driver, with every window switch it makes recorded in gen.moves."""
    gen.moves, move = [], gen._move
    gen._move = lambda window: (gen.moves.append(window), move(window))[1]
    return gen


def test_the_manifest_lists_the_ladder_and_every_graph_shares_one_weights_file(exported):
    art = exported(windows=LADDER)
    m = art.manifest
    assert m["windows"]["sizes"] == list(LADDER)
    for w in LADDER:
        for target in TARGETS:
            for step in ("prefill", "decode"):
                g = next(g for g in m["graphs"] if (g["step"], g["target"], g["window"]) == (step, target, w))
                assert (art.folder / g["file"]).exists() and g["external_data"] == "weights.data"
                cache = next(s for s in g["inputs"] if s["name"] == "past_key")
                assert cache["shape"][2] == w
                if target == "npu":
                    mask = next(s for s in g["inputs"] if s["name"] == "attention_mask")
                    assert mask["shape"][-1] == w + (16 if step == "prefill" else 1)
    assert m["graphs"][-1]["file"] in {f"decode.{t}.onnx" for t in TARGETS}  # C keeps the single-window names
    weights = sum(p.numel() for p in art.model().parameters()) * 4
    # once (the ort target's packed q/k/v once more, each tensor at a page), not once per graph (40 graphs)
    assert (art.folder / "weights.data").stat().st_size < 3 * weights
    assert {t: m["sequence_parity"]["targets"][t]["windows"] for t in TARGETS} == \
        {t: list(LADDER) if t in SWITCHING else [LADDER[-1]] for t in TARGETS}


@pytest.mark.parametrize("kind", ["attention", "block"])
@pytest.mark.parametrize("target", SWITCHING)
def test_sequence_parity_across_every_switch(exported, kind, target):
    """A 10-row prompt, then decode steps through positions 10..49: switches at 16 and at 32, against eager."""
    art = exported(kind, windows=LADDER)
    gen = recording(art.generator(target))
    res = sequence_parity(art.model(), gen, art.config, prompt_len=10, decode_steps=40, seed=5)
    print(f"{kind}/{target}: max abs {res['max_abs']:.2e} over windows {gen.moves}")
    assert within(res, "fp32"), res
    assert gen.moves == [32, 64] and gen.window == 64


@pytest.mark.parametrize("target", SWITCHING)
def test_chunks_ending_on_the_boundaries(exported, target):
    """A 32-row prompt: chunk 0..15 fills window 16 exactly, chunk 16..31 fills 32, the first decode step needs 64."""
    art = exported(windows=LADDER)
    gen = recording(art.generator(target))
    res = sequence_parity(art.model(), gen, art.config, prompt_len=32, decode_steps=3, seed=6)
    assert within(res, "fp32"), res
    assert gen.moves == [32, 64]


@pytest.mark.parametrize("target", ["onnx", "npu"])
def test_the_ladder_gives_the_single_window_outputs(exported, target):
    art = exported(windows=LADDER)
    x = np.random.default_rng(0).standard_normal((1, 45, 64)).astype(np.float32)
    outs = []
    for ladder in (True, False):
        gen = art.generator(target, ladder=ladder)
        outs.append(np.concatenate([gen.prefill(x[:, :20]), *[gen.decode(x[:, i:i + 1]) for i in range(20, 45)]], 1))
        assert gen.windows == (list(LADDER) if ladder else [64])
    assert np.abs(outs[0] - outs[1]).max() < 1e-5


@pytest.mark.parametrize("target", SWITCHING)
def test_going_back_to_a_smaller_window_keeps_its_rows(exported, target):
    """run_step at an earlier position (what a benchmark does) moves the caches down to its window, rows intact."""
    art = exported(windows=LADDER)
    gen = art.generator(target)
    rng = np.random.default_rng(1)
    gen.prefill(rng.standard_normal((1, 40, 64)).astype(np.float32))
    assert gen.window == 64
    before = rows(gen, 12)
    gen.run_step("decode", rng.standard_normal((1, 1, 64)).astype(np.float32), 12)
    assert gen.window == 16
    after = rows(gen, 12)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def rows(gen, n):
    caches = gen.caches.values() if hasattr(gen, "caches") else [v.numpy() for v in gen._past]
    return [c[:, :, :n].copy() for c in caches]


@pytest.mark.parametrize("target", ["onnx", "npu"])
def test_whole_model_token_parity_across_switches(exported, target):
    art = exported("lm", windows=LADDER)
    gen = recording(art.generator(target))
    res = token_parity(art.model(), gen, art.config, prompt_len=12, decode_steps=30, seed=7)
    print(f"lm/{target}: max abs {res['max_abs']:.2e}, top-1 {res['top1_agreement']:.0%}, windows {gen.moves}")
    assert within(res, "fp32"), res
    assert gen.moves == [32, 64]


def test_the_default_ladder_doubles_from_256_below_the_capacity():
    assert default(preset("minimind")) == (256, 512, 1024, 2048)
    assert default(preset("minimind", capacity=3000)) == (256, 512, 1024, 2048, 3000)
    assert default(preset("tiny")) == (64,)
    assert parse("none", preset("minimind")) == (2048,)
    assert parse("512, 1024", preset("minimind")) == (512, 1024, 2048)


@pytest.mark.parametrize("text, message", [
    ("8", r"windows \[8\]: each must hold a prefill chunk and fit the cache; expected 16 <= W <= 64"),
    ("128", r"windows \[128\]"),
    ("16,x", r"--windows '16,x': expected comma-separated row counts"),
])
def test_a_bad_ladder_is_refused_before_any_work(tmp_path, text, message, capsys):
    with pytest.raises(WindowError, match=message):
        parse(text, preset("tiny"))
    assert export_main(["--preset", "tiny", "--windows", text, "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "windows" in err
    assert not (tmp_path / "out").exists()


def test_cli_exports_a_ladder(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert export_main(["--preset", "tiny", "--windows", "32", "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["windows"]["sizes"] == [32, 64] and len(m["graphs"]) == 16
    assert "windows 32/64" in next(line for line in capsys.readouterr().out.splitlines() if "manifest.json" in line)


def test_a_switch_that_loses_the_rows_is_caught(exported, monkeypatch):
    """The parity check can fail: a move that drops the rows in use breaks the sequence at the first switch."""
    from runtime.drivers import CacheBuffers
    art = exported(windows=LADDER)

    def forgetful(self, old, new):
        views = self.view(new)
        for v in views:
            v[...] = 0
        return views
    monkeypatch.setattr(CacheBuffers, "move", forgetful)
    res = sequence_parity(art.model(), art.generator("onnx"), art.config, prompt_len=10, decode_steps=12, seed=5)
    assert not within(res, "fp32"), res


def test_a_window_just_below_the_capacity(exported):
    """Windows need not be powers of two: 60 rows next to C=64 (the export's own sequence check stays in the cache)."""
    art = exported(windows=(60, 64))
    gen = recording(art.generator("npu"))
    res = sequence_parity(art.model(), gen, art.config, prompt_len=50, decode_steps=14, seed=8)
    assert within(res, "fp32"), res
    # the padded last chunk (48..63) needs all 64 rows; decode steps 50..59 fit 60 again, 60.. need 64
    assert gen.moves == [64, 60, 64] and art.manifest["sequence_parity"]["targets"]["onnx"]["prompt_len"] == 48


@pytest.mark.parametrize("target", TARGETS)
def test_a_driver_let_go_is_freed_at_once(exported, target):
    """A driver holds every session of its ladder (a 135M model's: GBs of weights); one that no name holds goes at
    once, not when Python's cyclic collector next runs. Planted before the fix: cache buffers holding their driver, a
    cycle that kept SmolLM2-135M's drivers alive through its export's parity checks until 24 GiB ran out."""
    art = exported("lm", windows=LADDER)
    gen = art.generator(target)
    gen.reset()
    gen.feed(np.arange(40)[None] % art.config.vocab_size)
    gen.decode(np.array([[3]]))
    gone = weakref.ref(gen)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del gen
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


def _prepacks(session) -> bool:
    return prepacks(session.session.get_session_options())


def test_a_ladder_opens_every_window_up_front_on_one_mapping(exported, monkeypatch):
    """Every window's sessions are open before the first step (a window opened on its first use stalled that step by
    its open time), and they read the weights through one SharedWeights, unpacked (a copy each would be a copy per
    session). Planted: a session opened during generation is seen."""
    art = exported("lm", windows=LADDER)
    opened = []
    monkeypatch.setattr(runtime.artifacts, "open_step", lambda *a, **k: opened.append(a[1:4:2]) or open_step(*a, **k))
    gen = art.generator("onnx")
    assert sorted(opened) == sorted((step, w) for w in LADDER for step in ("prefill", "decode"))
    opened.clear()
    res = token_parity(art.model(), gen, art.config, prompt_len=12, decode_steps=30, seed=7)
    assert within(res, "fp32"), res
    assert opened == [], f"opened during generation: {opened}"
    sessions = [s for w in LADDER for s in gen._sessions(w)]
    assert len({id(s.weights) for s in sessions}) == 1 and sessions[0].weights is not None
    assert not any(_prepacks(s) for s in sessions)


@pytest.mark.parametrize("target", SWITCHING)
def test_every_decode_session_has_run_before_the_first_step(exported, monkeypatch, target):
    """A session's first run sets up its buffers (about 2x a later step; in a ladder, at a window crossing): the driver
    runs each window's decode step once as it opens, at that window's last row, and starts at position 0. Planted: a
    driver that skipped its warm-up records no such runs."""
    from runtime.drivers import Driver
    art, runs = exported("lm", windows=LADDER), []
    real = Driver._run
    monkeypatch.setattr(Driver, "_run", lambda self, step, x, p0: runs.append((step, p0, self.window)) or
                        real(self, step, x, p0))
    gen = art.generator(target)
    assert runs == [("decode", w - 1, prev) for w, prev in zip(LADDER, (LADDER[0], *LADDER[:-1]))]
    assert gen.position == 0 and gen.window == LADDER[0]
    res = token_parity(art.model(), gen, art.config, prompt_len=12, decode_steps=30, seed=7)
    assert within(res, "fp32"), res  # the rows the warm-up wrote change no output
    monkeypatch.setattr(Driver, "warm", lambda self: None)
    runs.clear()
    art.generator(target)
    assert runs == []


@pytest.mark.parametrize("threshold, shared", [(0, True), (1 << 40, False)])
def test_gqa_runs_over_the_capacity_alone_its_decode_pre_packed(exported, monkeypatch, threshold, shared):
    """GroupQueryAttention reads only the rows in use, so the ort target runs over the capacity's graphs alone, two
    sessions. Above SHARE_ABOVE they read one mapping, the decode step's pre-packed (a 0.6B decode step 1.2x faster),
    the prefill's not; below it each pre-packs its own copy. The onnx target (Attention reads every row of its window)
    keeps the ladder."""
    art = exported("lm", windows=LADDER)
    monkeypatch.setattr(runtime.artifacts, "SHARE_ABOVE", threshold)
    manifest = load_manifest(art.folder)
    assert reads_live_rows_only(manifest, "ort") and not reads_live_rows_only(manifest, "onnx")
    gen = art.generator("ort")
    assert gen.windows == [LADDER[-1]]
    res = token_parity(art.model(), gen, art.config, prompt_len=12, decode_steps=30, seed=7)
    assert within(res, "fp32"), res
    prefill, decode = gen._sessions(LADDER[-1])
    if shared:
        assert prefill.weights is decode.weights is not None and _prepacks(decode) and not _prepacks(prefill)
    else:
        assert prefill.weights is decode.weights is None and _prepacks(decode) and _prepacks(prefill)


def test_a_fresh_generate_process_reports_each_steps_window(exported):
    """`runtime.generate --json` in its own process, as benchmarks.fresh runs it: the window each step ran over, so the
    steps at a crossing are found, and the process's peak memory."""
    from benchmarks.fresh import command, crossings, once
    art = exported("lm", windows=LADDER)
    result = once(command("ort-onnx", {"export": art.folder}, list(range(1, 13)), threads=1))
    # 12 prompt rows fit 16; decode step i writes row 12 + i: 16 -> 32 at step 4, 32 -> 64 at step 20, then capacity
    assert result["prompt_window"] == 16 and result["stop"] == "capacity"
    assert result["decode_windows"] == [16] * 4 + [32] * 16 + [64] * 32
    assert crossings(result) == [4, 20] and len(result["decode_ms_steps"]) == 52
    assert result["peak_rss_bytes"] > 50 << 20 and result["open_ms"] > 0


def test_a_generate_process_runs_every_session_on_one_pool(exported):
    """`python -m runtime.generate` opens its sessions on one thread pool: with a pool each, the prefill session's
    threads still spun when the first decode step ran (2x a later step). Three windows' sessions at 2 threads: one
    pool's worker, not six."""
    art = exported("lm", windows=LADDER)
    code = ("import os, sys; import runtime.generate as g; opened = g.open_generator\n"
            "def counted(*a, **k):\n    d = opened(*a, **k); print('threads', len(os.listdir('/proc/self/task'))); return d\n"
            "g.open_generator = counted; g.main(sys.argv[2:], process=sys.argv[1] == '1')")
    args = [str(art.folder), "--target", "npu", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--threads", "2"]
    counts = {}
    for process in (True, False):
        res = subprocess.run([sys.executable, "-c", code, str(int(process)), *args], cwd=ROOT, capture_output=True,
                             text=True)
        assert res.returncode == 0, res.stderr
        counts[process] = int(res.stdout.split("threads ")[1].split()[0])
    assert counts[False] - counts[True] == 5, counts
