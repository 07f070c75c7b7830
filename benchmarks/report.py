"""results.md (the table, with ratios against torch-sdpa and ort-raw) and decode.png."""
from __future__ import annotations

from pathlib import Path

BASELINES = ("torch-sdpa", "ort-raw")


def _index(doc: dict) -> dict:
    return {(r["engine"], r["workload"]): r for r in doc["results"]}


def _targets(doc: dict) -> list[str]:
    """The issue's targets for the minimind preset, each with the measured value and whether it holds."""
    idx = _index(doc)
    med = lambda e, w: idx.get((e, w), {}).get("median_ms")  # noqa: E731
    lines = []

    def check(text, a, b, want):
        ratio = a / b if a and b else None
        verdict = "not measured" if ratio is None else f"{ratio:.2f}x ({'holds' if want(ratio) else 'missed'})"
        lines.append(f"- {text}: {verdict}")

    check("ort-ort decode@1024 vs torch-sdpa (want >= 3x faster)", med("torch-sdpa", "decode@1024"),
          med("ort-ort", "decode@1024"), lambda r: r >= 3)
    check("ort-ort decode@1024 vs ort-raw (want >= 2x faster)", med("ort-raw", "decode@1024"),
          med("ort-ort", "decode@1024"), lambda r: r >= 2)
    check("ort-ort prefill@0 vs torch-sdpa (want >= 4x faster)", med("torch-sdpa", "prefill@0"),
          med("ort-ort", "prefill@0"), lambda r: r >= 4)
    for w in dict.fromkeys(r["workload"] for r in doc["results"]):
        check(f"ort-onnx {w} vs ort-ort (want <= 1.3x slower)", med("ort-onnx", w), med("ort-ort", w), lambda r: r <= 1.3)
    for w in (w for w in dict.fromkeys(r["workload"] for r in doc["results"]) if w.endswith("decode@128")):
        check(f"ort-npu {w} vs its single-window form ort-npu-single (want >= 3x faster)", med("ort-npu-single", w),
              med("ort-npu", w), lambda r: r >= 3)
    floor = idx.get(("ort-ort", "decode@1024"), {}).get("floor_ms")
    check("ort-ort decode@1024 vs its bandwidth floor (want <= 1.5x)", med("ort-ort", "decode@1024"), floor, lambda r: r <= 1.5)
    lm = [w for w in dict.fromkeys(r["workload"] for r in doc["results"]) if w.startswith("lm/")]
    for w in lm:
        want = 1.5 if w.startswith("lm/prefill@128") else 1.2 if w.startswith("lm/decode@1024") else 1.0
        check(f"ort-ort {w} vs genai-fp32 (want >= {want}x faster)", med("genai-fp32", w), med("ort-ort", w),
              lambda r, want=want: r >= want)
    for w in (w for w in lm if w.startswith("lm/decode")):
        floor = idx.get(("ort-ort", w), {}).get("floor_ms")
        check(f"ort-ort {w} vs its bandwidth floor (want <= 1.3x)", med("ort-ort", w), floor, lambda r: r <= 1.3)
        check(f"ort-ort-int4 {w} vs genai-int4 (want >= 1.0x, target 1.2x)", med("genai-int4", w), med("ort-ort-int4", w),
              lambda r: r >= 1.0)
    for w in (w for w in lm if w.startswith("lm/prefill")):
        check(f"ort-ort-int4 {w} vs ort-ort fp32 (want >= 1.0x: prefill keeps fp32 speed)", med("ort-ort", w),
              med("ort-ort-int4", w), lambda r: r >= 1.0)
    return lines


def compact_table(doc: dict) -> list[str]:
    """Median ms, one row per workload, one column per engine."""
    idx = _index(doc)
    engines = list(dict.fromkeys(r["engine"] for r in doc["results"]))
    lines = ["| workload | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for w in dict.fromkeys(r["workload"] for r in doc["results"]):
        cells = [f"{idx[(e, w)]['median_ms']:.2f}" if "median_ms" in idx.get((e, w), {}) else "n/a" for e in engines]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(doc: dict, path: Path) -> None:
    m, lim, idx = doc["machine"], doc["limits"], _index(doc)
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads for every engine; "
             f"torch {m['torch']}, onnxruntime {m['onnxruntime']}. {doc['config']['dtype']}, {doc.get('preset', '')} preset "
             f"(E={doc['config']['hidden_size']}, H={doc['config']['num_heads']}, Hkv={doc['config']['num_kv_heads']}, "
             f"D={doc['config']['head_dim']}, C={doc['config']['capacity']}, T={doc['config']['chunk']}, B={doc['config']['batch']}).",
             "", f"Limits measured in the same run: fp32 GEMM {lim['gemm_flops'] / 1e9:.0f} GFLOP/s; read bandwidth at each "
             "decode working set " + ", ".join(f"{w} {b / 1e9:.1f} GB/s" for w, b in lim["read_bandwidth_bytes_per_s"].items()) + ".",
             "", "Median latency, ms:", "", *compact_table(doc), "", "Targets:", *_targets(doc), "",
             "| workload | engine | window | median ms | p90 ms | tokens/s | peak MB | floor ms | of roofline | vs torch-sdpa | vs ort-raw |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload in dict.fromkeys(r["workload"] for r in doc["results"]):
        for r in (r for r in doc["results"] if r["workload"] == workload):
            if "median_ms" not in r:
                lines.append(f"| {workload} | {r['engine']} | | unavailable: {r['unavailable']} | | | | | | | |")
                continue
            ratios = [idx.get((b, workload), {}).get("median_ms") for b in BASELINES]
            ratios = [f"{x / r['median_ms']:.2f}x" if x else "" for x in ratios]
            lines.append(f"| {workload} | {r['engine']} | {r.get('window', '')} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['tokens_per_s']:.0f} | "
                         f"{r['peak_mb']:.0f} | {r['floor_ms']:.3f} | {100 * r['roofline_fraction']:.0f}% | {ratios[0]} | {ratios[1]} |")
    rounds = doc.get("rounds", 1)
    lines += ["", "Ratios are speedups (baseline median / engine median), measured side by side in one run"
              + (f" of {rounds} rounds (every engine once per round, in turn, the order reversed every other round; "
                 "each row is its median round)" if rounds > 1 else "") + ". window: the "
              "cache rows the onnxruntime engine's graphs attended over (the smallest of the export's ladder holding the "
              "step; the -single engines run the capacity's graphs alone)."]
    path.write_text("\n".join(lines) + "\n")


def write_plot(doc: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"": "attention block", "block/": "decoder block", "lm/": "whole model"}
    prefixes = [p for p in titles if any(r["workload"].startswith(p + "decode@") for r in doc["results"])]
    fig, axes = plt.subplots(1, len(prefixes), figsize=(5.5 * len(prefixes), 4.2), sharey=False, squeeze=False)
    for ax, prefix in zip(axes[0], prefixes):
        for engine in dict.fromkeys(r["engine"] for r in doc["results"]):
            points = sorted((int(r["workload"].split("@")[1]), r["median_ms"]) for r in doc["results"]
                            if r["engine"] == engine and "median_ms" in r
                            and r["workload"].startswith(prefix + "decode@") and (prefix or "/" not in r["workload"]))
            if points:
                ax.plot(*zip(*points), marker="o", label=engine)
        ax.set_title(f"{titles[prefix]}: one decode step")
        ax.set_xlabel("cache fill (position)")
        ax.set_ylabel("median latency, ms")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """python -m benchmarks.report results.json: rewrite results.md and decode.png beside it."""
    import json
    import sys
    path = Path((argv or sys.argv[1:])[0])
    doc = json.loads(path.read_text())
    write_markdown(doc, path.with_name("results.md"))
    write_plot(doc, path.with_name("decode.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
