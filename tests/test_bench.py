"""The benchmark runs end to end and writes a well-formed results file (speed is never asserted)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ENGINES_RUN = ("torch-eager", "ort-onnxscript", "ort-ort", "ort-npu-single", "genai-fp32")


def test_bench_quick_writes_the_schema(tmp_path):
    # the engines with a path of their own: eager, optimize_for_ort's graphs, ours (through the window ladder, and the
    # host-cache driver over the capacity's graphs alone), and the genai peer (the rest of the onnxruntime engines
    # differ only in the graph they open, run by the other tests)
    res = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--preset", "tiny", "--out", str(tmp_path),
                          "--engines", *ENGINES_RUN], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"\[\s*13/14\] genai-fp32", res.stdout)  # the progress display counts every engine x workload
    doc = json.loads((tmp_path / "quick.json").read_text())
    assert set(doc) >= {"machine", "limits", "results"}
    assert doc["limits"]["gemm_flops"] > 0 and all(b > 0 for b in doc["limits"]["read_bandwidth_bytes_per_s"].values())
    rows = {(r["engine"], r["workload"]): r for r in doc["results"]}
    blocks = {(e, w) for e in ENGINES_RUN if not e.startswith("genai") for w in ("decode@63", "prefill@0")}
    lm = {(e, w) for e in ("torch-eager", "ort-ort", "genai-fp32") for w in ("lm/decode@63", "lm/prefill@64")}
    assert set(rows) == blocks | lm
    for r in rows.values():
        if "unavailable" in r:  # torch.compile may be missing a compiler: said, not hidden
            assert r["engine"] == "torch-compile" and r["unavailable"]
            continue
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["p90_ms"] <= r["max_ms"]
        assert r["tokens_per_s"] > 0 and r["peak_mb"] > 0 and 0 < r["roofline_fraction"]
        assert r.get("window") == (64 if r["engine"].startswith("ort-") else None)  # tiny: C=64, no smaller window
    # benchmarks.fresh's processes on the same weights: genai's own generator on its build, and ours on the export
    from benchmarks.fresh import command, once
    work = tmp_path / ".work" / "tiny-lm"
    folders = {"export": work, "genai-fp32": work / "genai-fp32"}
    theirs, ours = (once(command(e, folders, [1, 2, 3, 4, 5], threads=1, new_tokens=8)) for e in ("genai-fp32", "ort-ort"))
    for r in (theirs, ours):
        assert len(r["generated_ids"]) == 8 and len(r["decode_ms_steps"]) == 7 and r["peak_rss_bytes"] > 0
        assert 0 < r["decode_ms_median"] <= r["decode_ms_worst"] and r["open_ms"] > 0 and r["time_to_first_token_ms"] > 0
    assert theirs["generated_ids"] == ours["generated_ids"]


def _fresh(engine, prompt_tokens, crossing=None, **figures):
    return {"engine": engine, "prompt_tokens": prompt_tokens, "open_ms": 1000.0, "time_to_first_token_ms": 2000.0,
            "decode_ms_median": 30.0, "decode_ms_worst": 40.0, "worst_over_median": 1.3, "peak_rss_bytes": 1e9,
            "crossing_over_median": crossing, "crossing_steps": [0] if crossing else [], "generated_ids": [1, 2, 3],
            "decode_steps": 64, **figures}


def test_a_first_request_slower_than_genais_or_a_slow_crossing_is_missed():
    """The fresh-process targets at the longest prompt. Planted: a first token 1.1x genai's, a crossing step 2.5x its
    median; memory 1.4x (within 1.5x) and decode 1.05x (the limit) hold; the shorter prompt's figures are not judged."""
    from benchmarks.report import fresh_markdown, fresh_targets
    doc = {"rounds": 3, "round_order": "reversed", "threads": 2, "new_tokens": 65, "results": [
        _fresh("genai-fp32", 128), _fresh("ort-ort", 128, time_to_first_token_ms=9e9),
        _fresh("genai-fp32", 1024), _fresh("ort-ort", 1024, time_to_first_token_ms=2200.0, decode_ms_median=31.5,
                                            peak_rss_bytes=1.4e9, open_ms=2000.0, generated_ids=[1, 2, 4]),
        _fresh("ort-npu", 1024, crossing=2.5), _fresh("ort-npu", 128, crossing=1.5)]}
    lines = fresh_targets(doc)
    assert not any("at a 128-token prompt, as a multiple" in line for line in lines)
    assert "- ort-ort time_to_first_token_ms at a 1024-token prompt, as a multiple of genai-fp32's (at most 1.0x): " \
           "1.10x (missed)" in lines
    assert any(line.startswith("- ort-ort decode_ms_median") and line.endswith("1.05x (holds)") for line in lines)
    assert any(line.startswith("- ort-ort peak_rss_bytes") and line.endswith("1.40x (holds)") for line in lines)
    assert any(line.startswith("- ort-ort open_ms") and line.endswith("2.00x (holds)") for line in lines)
    assert "- ort-npu at a 1024-token prompt, its slowest window-crossing step (at most 2.0x its median): 2.50x " \
           "(missed)" in lines
    assert "- ort-npu at a 128-token prompt, its slowest window-crossing step (at most 2.0x its median): 1.50x " \
           "(holds)" in lines
    assert "| 1024 | ort-ort | 2000 | 2200 | 31.50 | 40.00 | 1.30x | none | 1.40 | 2 of 3 |" in fresh_markdown(doc)
    # planted: a prompt that ended at eos after 6 tokens; its decode median is not judged, either way
    doc["results"][3] |= {"decode_steps": 6, "decode_ms_median": 90.0}
    assert any(line.startswith("- ort-ort decode_ms_median") and line.endswith("not judged, 6 decode steps (fewer "
                                                                             "than 32: the prompt ended at eos)")
               for line in fresh_targets(doc))


def test_fresh_summary_takes_medians_over_rounds_and_finds_the_crossings():
    from benchmarks.fresh import summary
    runs = [{"open_ms": o, "time_to_first_token_ms": 10.0, "decode_ms_median": 10.0, "decode_ms_worst": w,
             "decode_ms_steps": [w, 10.0, 10.0, 12.0], "prompt_window": 256, "decode_windows": [512, 512, 512, 1024],
             "peak_rss_bytes": 100, "generated_ids": [1], "prompt_ids": [0]} for o, w in ((3.0, 30.0), (1.0, 15.0), (2.0, 25.0))]
    s = summary(runs)
    assert s["open_ms"] == 2.0 and s["decode_ms_worst"] == 25.0 and s["crossing_steps"] == [0, 3]
    assert s["crossing_over_median"] == 2.5 and s["worst_over_median"] == 2.5
    assert len(s["rounds"]) == 3 and "prompt_ids" not in s["rounds"][0]


def test_rounds_keep_each_workloads_median_round():
    from benchmarks.__main__ import median_rounds
    rows = [{"engine": "a", "workload": "w", "median_ms": m, "run": i} for i, m in enumerate((3.0, 1.0, 2.0))]
    rows += [{"engine": "b", "workload": "w", "median_ms": 1.0}, {"engine": "b", "workload": "w", "unavailable": "x"}]
    merged = median_rounds(rows)
    assert merged[0] == {"engine": "a", "workload": "w", "median_ms": 2.0, "run": 2, "round_medians_ms": [3.0, 1.0, 2.0]}
    assert merged[1] == {"engine": "b", "workload": "w", "unavailable": "x"} and len(merged) == 2


def test_rounds_alternate_the_engine_order():
    from benchmarks.__main__ import round_order
    assert [round_order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def _doc(*rows):
    return {"results": [{"engine": e, "workload": w, "median_ms": m, **extra} for e, w, m, extra in rows]}


def _target(doc, text):
    from benchmarks.report import targets
    return next(line for line in targets(doc) if text in line)


def test_a_time_under_its_floor_says_the_floor_is_invalid():
    doc = _doc(("ort-ort", "lm/decode@128", 9.0, {"floor_ms": 10.0}))
    assert "0.90x (floor invalid (measured faster than the floor" in _target(doc, "lm/decode@128 vs its bandwidth floor")
    doc = _doc(("ort-ort", "lm/decode@128", 12.0, {"floor_ms": 10.0}))
    assert _target(doc, "lm/decode@128 vs its bandwidth floor").endswith("1.20x (holds)")


def test_a_missing_engine_is_not_measured_and_a_slow_one_missed():
    doc = _doc(("ort-ort", "lm/decode@1024", 10.0, {}), ("genai-fp32", "lm/decode@1024", 11.0, {}))
    assert _target(doc, "ort-ort-int4 lm/decode@1024 vs genai-int4").endswith(": not measured")
    assert _target(doc, "ort-ort lm/decode@1024 vs genai-fp32 (want >= 1.2x").endswith("1.10x (missed)")


def test_a_trained_model_run_alone_reports_its_targets_only():
    from benchmarks.report import targets
    doc = _doc(("ort-ort", "smollm2/decode@128", 30.0, {"floor_ms": 20.0}), ("genai-fp32", "smollm2/decode@128", 36.0, {}),
               ("llamacpp-f32", "smollm2/decode@128", 32.0, {}))
    doc["models"] = {"smollm2": {}}
    lines = targets(doc)
    assert "- ort-ort smollm2/decode@128 vs genai-fp32 (want >= 1.1x faster): 1.20x (holds)" in lines
    assert "- ort-ort smollm2/decode@128 vs llamacpp-f32 (want >= 1.1x faster): 1.07x (missed)" in lines
    assert "- ort-ort-int4 smollm2/decode@128 vs genai-int4 (want >= 1.0x faster): not measured" in lines
    assert "- ort-ort smollm2/decode@128: 30.00 ms against its bandwidth floor of 20.00 ms (1.50x the floor)" in lines
    assert not any("torch-sdpa" in line or "lm/" in line for line in lines)  # the preset's workloads did not run


def test_a_trained_target_under_the_floor_shows_the_arithmetic():
    """A target asking for a time under our floor says so; a peer measured under its own floor is flagged; a target
    above the floor, or one whose peer respects its floor, gets neither note."""
    from benchmarks.report import targets
    doc = _doc(("ort-ort", "smollm2/decode@128", 16.0, {"floor_ms": 14.0}),
               ("genai-fp32", "smollm2/decode@128", 14.5, {"floor_ms": 14.0}),
               ("llamacpp-f32", "smollm2/decode@128", 13.0, {"floor_ms": 14.0}),
               ("ort-ort-int4", "smollm2/decode@128", 5.5, {"floor_ms": 2.7}),
               ("genai-int4", "smollm2/decode@128", 4.0, {"floor_ms": 2.4}))
    doc["models"] = {"smollm2": {}}
    lines = targets(doc)
    assert "- ort-ort smollm2/decode@128 vs genai-fp32 (want >= 1.1x faster): 0.91x (missed); 1.1x faster than " \
           "genai-fp32's 14.50 ms is 13.18 ms, under ort-ort's floor of 14.00 ms" in lines
    assert "- ort-ort smollm2/decode@128 vs llamacpp-f32 (want >= 1.1x faster): 0.81x (missed); 1.1x faster than " \
           "llamacpp-f32's 13.00 ms is 11.82 ms, under ort-ort's floor of 14.00 ms; llamacpp-f32 itself ran under " \
           "its floor of 14.00 ms: this run's timing or its bandwidth figure is off" in lines
    assert "- ort-ort-int4 smollm2/decode@128 vs genai-int4 (want >= 1.0x faster): 0.73x (missed)" in lines


def test_a_scaled_shape_reports_the_targets_of_the_peers_it_runs_alone():
    """qwen3-0.6b runs genai, not llama.cpp: its llama.cpp targets are not its own, not 'not measured'."""
    from benchmarks.report import targets
    doc = _doc(("ort-ort", "qwen3-0.6b/decode@128", 300.0, {"floor_ms": 200.0}),
               ("genai-fp32", "qwen3-0.6b/decode@128", 360.0, {}))
    doc["models"] = {"qwen3-0.6b": {}}
    lines = targets(doc)
    assert "- ort-ort qwen3-0.6b/decode@128 vs genai-fp32 (want >= 1.1x faster): 1.20x (holds)" in lines
    assert "- ort-ort-int4 qwen3-0.6b/decode@128 vs genai-int4 (want >= 1.0x faster): not measured" in lines
    assert not any("llamacpp" in line for line in lines), lines


def test_the_report_names_an_engine_that_ran_another_window():
    from benchmarks.report import window_differences
    doc = _doc(("ort-raw", "decode@128", 1.0, {"window": 256}), ("ort-onnxscript", "decode@128", 3.0, {"window": 2048}),
               ("ort-npu-single", "decode@128", 2.0, {"window": 2048}), ("torch-sdpa", "decode@128", 4.0, {}))
    assert window_differences(doc) == ["- ort-onnxscript decode@128: 2048 rows, where ort-raw's ladder ran 256"]


def test_onnxscript_runs_the_raw_graphs_ladder(tmp_path):
    # optimize_for_ort's graphs are made per window, so ort-onnxscript attends over the rows ort-raw does
    import numpy as np
    from benchmarks.__main__ import prepare
    from benchmarks.engines import Engine
    from benchmarks.workloads import Workload
    from models import preset
    config = preset("tiny").replace(capacity=512)  # ladder 256, 512
    folders = prepare(config, "attention", tmp_path / "a", ["ort-raw", "ort-onnxscript"])
    raw, rewritten = (Engine(e, config, folders, 1) for e in ("ort-raw", "ort-onnxscript"))
    for p0, window in ((100, 256), (400, 512)):
        w = Workload("attention", "decode", p0)
        outs = [np.asarray(e.runner(w)()[0]) for e in (raw, rewritten)]
        assert raw.window(w) == rewritten.window(w) == window
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_genai_builds_are_rebuilt_when_the_weights_change(tmp_path, monkeypatch):
    import benchmarks.__main__ as bench
    from models import build_model, preset
    built = []

    def fake_build(model, folder, engines):
        built.append(list(engines))
        for e in engines:
            (folder / e).mkdir(exist_ok=True)
            (folder / e / "genai_config.json").write_text("{}")
    monkeypatch.setattr(bench, "build_genai", fake_build)
    config = preset("tiny")
    bench.prepare_genai(build_model(config, "lm", seed=0), tmp_path, ["genai-fp32"])
    bench.prepare_genai(build_model(config, "lm", seed=0), tmp_path, ["genai-fp32"])  # same weights: reused
    bench.prepare_genai(build_model(config, "lm", seed=1), tmp_path, ["genai-fp32"])  # files exist, weights differ
    assert built == [["genai-fp32"], ["genai-fp32"]]


def test_transformers_sourced_engine_runs_the_same_weights(tmp_path, monkeypatch):
    # ort-ort-hf is only a fair comparison if it computes what ort-ort computes: the same weights, through
    # transformers' Qwen3ForCausalLM; a folder of other weights (planted: seed 1) must show in the logits
    import benchmarks.__main__ as bench
    from benchmarks.engines import Engine
    from benchmarks.workloads import Workload
    from export import export_model
    from models import preset
    from runtime.metrics import TOLERANCE, close, error
    config = preset("tiny", capacity=32, chunk=8)
    export_model(config, tmp_path / "course", kind="lm", targets=("ort",), log=lambda *_: None)
    bench.prepare_transformers(config, tmp_path, tmp_path / "ort-ort-hf")
    folders = {"lm": tmp_path / "course", "ort-ort-hf": tmp_path / "ort-ort-hf"}
    steps = [Workload("lm", "prefill", 24), Workload("lm", "decode", 20)]

    def outputs(name):
        engine = Engine(name, config, folders, threads=1)
        return [np.asarray(engine.runner(w)()) for w in steps]
    course = outputs("ort-ort")
    for got, want in zip(outputs("ort-ort-hf"), course):
        assert close(error(got, want), TOLERANCE["fp32"]), error(got, want)
    seeded = bench.build_model
    monkeypatch.setattr(bench, "build_model", lambda c, kind, seed=0: seeded(c, kind, seed=1))
    (tmp_path / "ort-ort-hf" / "fingerprint").unlink()
    bench.prepare_transformers(config, tmp_path, tmp_path / "ort-ort-hf")
    assert not any(close(error(got, want), TOLERANCE["fp32"]) for got, want in zip(outputs("ort-ort-hf"), course))


def test_scale_rows_merge_and_a_failed_export_is_a_row(tmp_path, monkeypatch):
    """benchmarks.scale run on one shape keeps the others' rows, replaces its own, and a failed export is a row with
    its error line; the export itself (a tiny random folder, in its own process) is measured for real."""
    from benchmarks import scale
    old = [{"model": "qwen3-0.6b", "params": 596e6, "variant": "fp32", "wall_s": 700, "peak_rss_bytes": 4e9},
           {"model": "minimind", "params": 64e6, "variant": "fp32", "wall_s": 1, "peak_rss_bytes": 1}]
    (tmp_path / "results.json").write_text(json.dumps({"results": old}))
    new = [{"model": "minimind", "params": 64e6, "variant": "fp32", "wall_s": 300, "peak_rss_bytes": 3e9}]
    merged = scale._merged(tmp_path, new)
    assert [(r["model"], r["wall_s"]) for r in merged] == [("minimind", 300), ("qwen3-0.6b", 700)]
    from models import build_model, preset
    from models.checkpoint import save_hf_folder
    folder = tmp_path / "tiny"
    save_hf_folder(build_model(preset("tiny"), "lm", 0), str(folder))
    held = np.ones(1 << 30, np.uint8)  # planted: the export's own peak, not this process's pages a fork would count
    row = scale.export_run(folder, tmp_path / "tiny-fp32", ["--windows", "none", "--capacity", "64", "--chunk", "16"],
                           timeout=600)
    assert row["exit"] == 0 and row["graphs"] == 8 and 100e6 < row["peak_rss_bytes"] < held.sum(), row
    assert {"trace", "passes", "checks", "sequence parity"} <= set(row["stages_s"])
    bad = scale.export_run(folder, tmp_path / "bad", ["--windows", "7"], timeout=600)
    assert bad["exit"] != 0 and bad["error"].startswith("error: ") and "windows" in bad["error"], bad
    named = {"model": "tiny", "params": 1e5, "variant": "fp32"}
    table = scale.markdown({"machine": "m", "results": [{**row, **named}, {**bad, **named, "variant": "int4"}]})
    assert "| tiny | 0M | 0.00 | fp32 |" in table and "| int4 |" in table and "failed: error: " in table


def test_a_fresh_process_that_fails_is_one_clear_error():
    import pytest
    from benchmarks.fresh import once
    with pytest.raises(RuntimeError, match=r"exited with 1: planted failure"):
        once([sys.executable, "-c", "import sys; print('x' * 100000, file=sys.stderr); sys.exit('planted failure')"])


def test_a_fresh_process_reports_its_own_peak_memory_not_its_parents():
    """Planted: this process holds 400 MB more when it starts the child; a child's wait4 rusage would count them (it
    is forked from this image), its own VmHWM does not."""
    from benchmarks.fresh import once
    held = np.ones(400 << 20, np.uint8)
    child = once([sys.executable, "-c", "import json; from runtime.cli import peak_rss_bytes; "
                  "print(json.dumps({'peak_rss_bytes': peak_rss_bytes()}))"])
    assert held.sum() == 400 << 20 and 0 < child["peak_rss_bytes"] < 300 << 20


def test_the_timed_processes_do_not_import_torch():
    """Each engine's process is measured for its own peak memory: one that imported torch would carry 250 MB that
    neither the engine nor its user's process needs (benchmarks.peers once made genai's look 1.28 GB, not 1.05)."""
    import subprocess
    for module in ("runtime.generate", "benchmarks.genai_generate"):
        probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "[]", (module, out)
