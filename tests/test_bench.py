"""The benchmark runs end to end and writes a well-formed results file (speed is never asserted)."""
import json
import re
import subprocess
import sys
from pathlib import Path

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
