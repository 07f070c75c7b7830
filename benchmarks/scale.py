"""python -m benchmarks.scale: how an export's time and memory grow with the model (issue 22).

Random-weight Hugging Face folders of real shapes, saved as transformers saves them (bf16 safetensors, sharded
above 2 GB), each exported by `python -m export --kind lm` in its own process: the default window ladder and every
target, and again with `--quant int4`. Per run: wall time, peak RSS (the process's own, as it reports it), the weights
file and graph bytes, and the export's own split of its time (its closing `time: ...` line). A run that fails is a
row with its `error:` line. Not part of the test suite: the 1.7B shape alone takes minutes and gigabytes.

Writes benchmarks/scale/results.json, results.md and scale.png (time and peak memory against parameters).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from models import preset
from runtime.cli import Parser, run

from . import provenance, report

ROOT = Path(__file__).resolve().parents[1]
GB = 1024 ** 3
WORK = ROOT / "benchmarks" / ".work" / "scale"  # the shapes' folders and their exports
_MM = preset("minimind")
# transformers config fields of each shape (random weights): the minimind preset's, and the checkpoints people deploy
SHAPES = {
    "minimind": dict(model_type="qwen3", num_hidden_layers=_MM.num_layers, hidden_size=_MM.hidden_size,
                     intermediate_size=_MM.ffn_size, num_attention_heads=_MM.num_heads,
                     num_key_value_heads=_MM.num_kv_heads, head_dim=_MM.head_dim, vocab_size=_MM.vocab_size),
    "qwen3-0.6b": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "llama-3.2-1b": dict(model_type="llama", num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "qwen3-1.7b": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=2048, intermediate_size=6144,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
}
VARIANTS = {"fp32": [], "int4": ["--quant", "int4"]}
STAGES = re.compile(r"^time: (\d+) s \((.*)\)$")
PEAK = re.compile(r"^peak memory: ([\d.]+) GiB$")  # export/__main__.py's last line


def make_folder(name: str, folder: Path) -> int:
    """The shape's random-weight folder (bf16, sharded above 2 GB, tied embeddings, a small trained tokenizer:
    onnxruntime-genai's builder needs one), written once; its parameter count (tied weights once)."""
    import torch
    import transformers
    from corpus.text import save_tokenizer
    shape = dict(SHAPES[name])
    if not (folder / "config.json").exists():
        config = transformers.AutoConfig.for_model(shape.pop("model_type"), tie_word_embeddings=True,
                                                   max_position_embeddings=32768, **shape)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        staging = folder.with_name(folder.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, max_shard_size="2GB")
        save_tokenizer(staging, 512)
        staging.rename(folder)
        del model
    elif not (folder / "tokenizer.json").exists():  # a folder made before the tokenizer was
        save_tokenizer(folder, 512)
    return parameters(folder)


def parameters(folder: Path) -> int:
    """Parameters stored in the folder's safetensors files (read from their headers, no tensor loaded)."""
    from safetensors import safe_open
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def export_run(folder: Path, out: Path, extra: list[str], timeout: float) -> dict:
    """One `python -m export` of the folder in its own process: wall time, its own peak RSS, its time split."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "export", "--kind", "lm", "--weights", str(folder), "--out", str(out), *extra]
    start = time.perf_counter()
    log_path = out.parent / f"{out.name}.log"  # not with_suffix: "qwen3-0.6b-fp32" has a dot
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = start + timeout
        while (status := os.wait4(proc.pid, os.WNOHANG))[0] == 0:
            if time.perf_counter() > deadline:
                proc.kill()
            time.sleep(0.5)
    wall = time.perf_counter() - start
    _, code, _ = status
    lines = log_path.read_text(errors="replace").splitlines()
    row = {"command": " ".join(cmd[1:]), "wall_s": round(wall, 1), "exit": os.waitstatus_to_exitcode(code)}
    # the export's own peak (its last line): wait4's rusage also counts the pages of this process it was forked from
    peak = next((PEAK.match(ln) for ln in reversed(lines) if PEAK.match(ln)), None)
    row["peak_rss_bytes"] = round(float(peak[1]) * 2**30) if peak else None
    if row["exit"] != 0:
        row["error"] = next((ln for ln in reversed(lines) if ln.startswith("error:")),
                            f"exited with {row['exit']}" + (" (timed out)" if wall >= timeout else ""))
        return row
    stages = next((STAGES.match(ln) for ln in reversed(lines) if STAGES.match(ln)), None)
    if stages:
        row["stages_s"] = {k: float(v) for k, v in (p.rsplit(" ", 2)[:2] for p in stages[2].split(", "))}
    row["weights_bytes"] = (out / "weights.data").stat().st_size if (out / "weights.data").exists() else 0
    row["graph_bytes"] = sum(p.stat().st_size for p in out.glob("*.onnx"))
    row["graphs"] = len(list(out.glob("*.onnx")))
    return row


def markdown(doc: dict) -> str:
    lines = [f"Export cost against model size ({doc['machine']}); `python -m export --kind lm` per row, the default "
             "window ladder and every target (+ `--quant int4` where named), random bf16 weights.", "",
             "| model | params | fp32 weights GiB | variant | wall s | peak RSS GiB | RSS / fp32 weights | s per 100M params "
             "| graphs | stages (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        fp32 = 4 * r["params"]
        peak = r.get("peak_rss_bytes")
        head = f"| {r['model']} | {r['params'] / 1e6:.0f}M | {fp32 / GB:.2f} | {r['variant']} | {r['wall_s']:.0f} | " + \
               (f"{peak / GB:.2f} | {peak / fp32:.2f}x | " if peak else "not reported | | ")
        if "error" in r:
            lines.append(head + f"failed: {r['error'][:160]} | | |")
            continue
        stages = ", ".join(f"{k} {v:.0f}" for k, v in r.get("stages_s", {}).items())
        lines.append(head + f"{100e6 * r['wall_s'] / r['params']:.1f} | {r['graphs']} | {stages} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict) -> bytes:
    import io
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in dict.fromkeys(r["variant"] for r in doc["results"]):
        rows = sorted((r for r in doc["results"] if r["variant"] == variant and "error" not in r), key=lambda r: r["params"])
        if rows:
            x = [r["params"] / 1e6 for r in rows]
            axes[0].plot(x, [r["wall_s"] for r in rows], marker="o", label=variant)
            axes[1].plot(x, [r["peak_rss_bytes"] / GB for r in rows], marker="o", label=variant)
    for ax, what in zip(axes, ("export wall time, s", "peak RSS, GiB")):
        ax.set_xlabel("parameters, millions")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _merged(out: Path, results: list[dict]) -> list[dict]:
    """The rows already in out/results.json, each (model, variant) measured now replaced: a shape can be run alone
    (the 1.7B one takes most of an hour) without losing the others. Ordered by parameters, then variant."""
    path, fresh = out / "results.json", {(r["model"], r["variant"]) for r in results}
    old = json.loads(path.read_text())["results"] if path.exists() else []
    rows = [r for r in old if (r["model"], r["variant"]) not in fresh] + results
    return sorted(rows, key=lambda r: (r["params"], list(VARIANTS).index(r["variant"])))


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=SHAPES, help="shapes to export [all]")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="exports per shape [all]")
    p.add_argument("--work", default=str(WORK),
                   help="where the folders and exports go [benchmarks/.work/scale]")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "scale"), help="result folder [benchmarks/scale]")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one export may run [3600]")
    return run(measure, p.parse_args(argv))


def measure(args) -> int:
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    results, start = [], provenance.stamp(also=("export.__main__",))
    for name in args.models:
        params = make_folder(name, work / name)
        for variant in args.variants:
            print(f"{name} ({params / 1e6:.0f}M parameters), {variant} ...", flush=True)
            row = {"model": name, "params": params, "variant": variant,
                   **export_run(work / name, work / f"{name}-{variant}", VARIANTS[variant], args.timeout)}
            shutil.rmtree(work / f"{name}-{variant}", ignore_errors=True)  # gigabytes each; the row keeps the sizes
            peak = f"{row['peak_rss_bytes'] / GB:.2f} GiB" if row["peak_rss_bytes"] else "not reported"
            print(f"  {row['wall_s']:.0f} s, peak RSS {peak}" + (f": {row['error']}" if "error" in row else ""), flush=True)
            results.append(row)
    provenance.unchanged(start)
    earlier = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    doc = provenance.keep({"machine": f"{provenance.cpu()}, {os.cpu_count()} cores", "results": _merged(out, results)},
                          earlier, provenance.stamp(also=("export.__main__",)))
    files = {"results.json": (json.dumps(doc, indent=2) + "\n").encode(), "results.md": report.beside(out / "results.json", doc, markdown).encode(),
             "scale.png": plot(doc)}
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (out / name).write_bytes(content)
    print(f"wrote {', '.join(str(out / n) for n in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
