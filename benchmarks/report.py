"""results.md (the table, with ratios against torch-sdpa and ort-raw) and decode.png."""
from __future__ import annotations

from pathlib import Path

BASELINES = ("torch-sdpa", "ort-raw")


def _index(doc: dict) -> dict:
    return {(r["engine"], r["workload"]): r for r in doc["results"]}


def _targets(doc: dict) -> list[str]:
    """The issue's targets, each with the measured value and whether it holds."""
    idx = _index(doc)
    med = lambda e, w: idx.get((e, w), {}).get("median_ms")  # noqa: E731
    lines = []

    def check(text, a, b, want):
        if a is None or b is None:
            lines.append(f"- {text}: not measured")
            return
        ratio = a / b
        lines.append(f"- {text}: {ratio:.2f}x ({'holds' if want(ratio) else 'missed'})")

    decode = next((w for (e, w) in idx if w.startswith("decode@") and w != "decode@128" and not w.endswith("2047")), None)
    check(f"ort-ort {decode} faster than torch-sdpa (want >= 3x)", med("torch-sdpa", decode), med("ort-ort", decode), lambda r: r >= 3)
    check(f"ort-ort {decode} faster than ort-raw (want >= 2x)", med("ort-raw", decode), med("ort-ort", decode), lambda r: r >= 2)
    check("ort-ort prefill@0 faster than torch-sdpa (want >= 4x)", med("torch-sdpa", "prefill@0"), med("ort-ort", "prefill@0"),
          lambda r: r >= 4)
    worst = max(((med("ort-onnx", w) / med("ort-ort", w), w) for (e, w) in idx
                 if e == "ort-ort" and med("ort-onnx", w) and med("ort-ort", w)), default=None)
    if worst:
        lines.append(f"- ort-onnx within 1.3x of ort-ort on every workload: worst {worst[0]:.2f}x at {worst[1]} "
                     f"({'holds' if worst[0] <= 1.3 else 'missed'})")
    frac = idx.get(("ort-ort", decode), {}).get("roofline_fraction")
    if frac:
        lines.append(f"- ort-ort {decode} within 1.5x of its bandwidth floor: {1 / frac:.2f}x the floor "
                     f"({'holds' if 1 / frac <= 1.5 else 'missed'})")
    return lines


def write_markdown(doc: dict, path: Path) -> None:
    m, lim, idx = doc["machine"], doc["limits"], _index(doc)
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads for every engine; "
             f"torch {m['torch']}, onnxruntime {m['onnxruntime']}. fp32, minimind preset "
             f"(E={doc['config']['hidden_size']}, H={doc['config']['num_heads']}, Hkv={doc['config']['num_kv_heads']}, "
             f"D={doc['config']['head_dim']}, C={doc['config']['capacity']}, T={doc['config']['chunk']}, B={doc['config']['batch']}).",
             "", f"Limits measured in the same run: fp32 GEMM {lim['gemm_flops'] / 1e9:.0f} GFLOP/s; read bandwidth at each "
             "decode working set " + ", ".join(f"{w} {b / 1e9:.1f} GB/s" for w, b in lim["read_bandwidth_bytes_per_s"].items()) + ".",
             "", "Targets:", *_targets(doc), "",
             "| workload | engine | median ms | p90 ms | tokens/s | peak MB | floor ms | of roofline | vs torch-sdpa | vs ort-raw |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for workload in dict.fromkeys(r["workload"] for r in doc["results"]):
        for r in (r for r in doc["results"] if r["workload"] == workload):
            if "median_ms" not in r:
                lines.append(f"| {workload} | {r['engine']} | unavailable: {r['unavailable']} | | | | | | | |")
                continue
            ratios = [idx.get((b, workload), {}).get("median_ms") for b in BASELINES]
            ratios = [f"{x / r['median_ms']:.2f}x" if x else "" for x in ratios]
            lines.append(f"| {workload} | {r['engine']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['tokens_per_s']:.0f} | "
                         f"{r['peak_mb']:.0f} | {r['floor_ms']:.3f} | {100 * r['roofline_fraction']:.0f}% | {ratios[0]} | {ratios[1]} |")
    lines += ["", "Ratios are speedups (baseline median / engine median), measured side by side in one run."]
    path.write_text("\n".join(lines) + "\n")


def write_plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, prefix in zip(axes, ("", "block/")):
        for engine in dict.fromkeys(r["engine"] for r in doc["results"]):
            points = sorted((int(r["workload"].split("@")[1]), r["median_ms"]) for r in doc["results"]
                            if r["engine"] == engine and "median_ms" in r
                            and r["workload"].startswith(prefix + "decode@") and (prefix or "/" not in r["workload"]))
            if points:
                ax.plot(*zip(*points), marker="o", label=engine)
        ax.set_title(f"{'decoder block' if prefix else 'attention block'}: one decode step")
        ax.set_xlabel("cache fill (position)")
        ax.set_ylabel("median latency, ms")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
