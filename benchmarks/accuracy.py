"""python -m benchmarks.accuracy: the quantized whole models against fp32 eager PyTorch, beside the peers.

python -m benchmarks.accuracy: the quantized whole models against fp32 eager PyTorch, side by side with
onnxruntime-genai's builds of the same weights, on one fixed prompt set (runtime/accuracy.py).

Random weights (the preset's, default): uses the graphs `make bench` exports (benchmarks/.work/PRESET-lm, exported
here if missing) and writes benchmarks/accuracy.json and accuracy.md.

A trained model (`--model smollm2`): every engine against fp32 transformers on the committed prompt set
(benchmarks/prompts.json: chat messages through the folder's chat template, prose and code as plain text), each
prompt read and then 64 greedy tokens: every target of ours (the fp32 ones, int4 at accuracy levels 4 and 0, int8,
w8a16), onnxruntime-genai's fp32 and int4 builds of the folder, and llama.cpp on GGUFs of it (F32 and Q4_0 converted
from it, its original Q4_1). Writes benchmarks/MODEL/accuracy.json and accuracy.md.

`--engines a,b` measures those engines alone and keeps every other row of the accuracy.json already there (a change
that moves one engine's numbers reruns that engine, not the hour the others take); its `measured` says which run made
each row.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import torch

import registry
from models import build_model, preset
from runtime import accuracy
from runtime.artifacts import load_manifest, open_generator
from runtime.cli import Parser, run
from runtime.parity import reference_model
from runtime.text import chat_ids, load_tokenizer, prompt_ids

from . import llamacpp, provenance
from .__main__ import ARTIFACTS, TRAINED_QUANT, model_configs, prepare, prepare_folder
from .peers import GenaiDriver
from .report import accuracy_markdown, beside
from .workloads import GENAI, LLAMACPP, TRAINED

# random weights: the default target and every quantized one; a trained model: every target, and int4 at level 0
QUANTIZED = tuple(n for n, t in registry.TARGETS.items() if t.scheme)
TARGETS = (registry.RUN_BY_DEFAULT, *QUANTIZED)
PEERS = ("genai-fp32", "genai-int4")
COLUMNS = ("max_rel", "mean_rel", "kl_mean", "kl_max", "top1", "greedy_match")
PROMPTS = Path(__file__).with_name("prompts.json")
TRAINED_STEPS = 64  # greedy tokens per prompt on a trained model
# the MatMulNBits targets, also measured at accuracy level 0 (fp32 compute rather than int8 activations): same weights
LEVELLED = tuple(t for t in QUANTIZED if registry.target(t).scheme.quantizer == "blocks")
LEVEL_0 = {f"{t}-l0": t for t in LEVELLED}  # {the row's name: the target it runs at level 0}
TRAINED_TARGETS = (*registry.float_targets(), *(q for t in QUANTIZED for q in (t, *(f"{t}-l0",) * (t in LEVELLED))))


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="minimind", help="model config [minimind]")
    p.add_argument("--model", choices=TRAINED, help="a trained model (python -m models.fetch NAME) instead of the "
                   "preset's random weights")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads [all cores]")
    p.add_argument("--out", default="benchmarks", help="output folder [benchmarks]")
    p.add_argument("--engines", type=lambda s: [e.strip() for e in s.split(",") if e.strip()],
                   help="measure only these engines, keeping the other rows of the accuracy.json there [all]")
    args = p.parse_args(argv)
    return run(measure_trained if args.model else measure_all, args)


def measure_all(args) -> int:
    config, out, start = preset(args.preset), Path(args.out), provenance.stamp()
    wanted = _wanted(args.engines, TARGETS + PEERS, out / "accuracy.json")
    folders = prepare(config, "lm", out / ".work" / f"{args.preset}-lm", [p for p in PEERS if p in wanted],
                      quantized=True)
    model = reference_model(build_model(config, "lm", seed=0))
    prompts = accuracy.prompt_set(config)
    refs = accuracy.references(model, prompts)
    rows, grids = {}, {}
    for target in (t for t in TARGETS if t in wanted):
        rows[target] = accuracy.measure(open_generator(folders["lm"], target, provider="cpu", threads=args.threads),
                                        prompts, refs) | held(target, model, prompts, refs, config.vocab_size, grids)
        print(f"{target:14s} {_line(rows[target])}", flush=True)
    for peer in (p for p in PEERS if p in wanted):
        if not (folders[peer] / "genai_config.json").exists():
            print(f"{peer}: not built (onnxruntime-genai is not installed)")
            continue
        driver = GenaiDriver(folders[peer], args.threads, max_length=config.capacity)
        rows[peer] = accuracy.measure(driver, prompts, refs)
        print(f"{peer:14s} {_line(rows[peer])}", flush=True)
    doc = _kept({"preset": args.preset, "reference": "eager PyTorch fp32, same weights",
                 "prompts": [int(p.shape[1]) for p in prompts], "decode_steps": accuracy.DECODE_STEPS, "results": rows},
                out / "accuracy.json", TARGETS + PEERS, wanted, start)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "accuracy.md").write_text(beside(out / "accuracy.json", doc, accuracy_markdown))
    print(f"wrote {out / 'accuracy.json'}, {out / 'accuracy.md'}")
    return 0


def measure_trained(args) -> int:
    config, start = model_configs(preset(args.preset), [args.model])[args.model], provenance.stamp()
    weights, out = ARTIFACTS / args.model, Path(args.out)
    engines = TRAINED_TARGETS + GENAI + LLAMACPP
    wanted = _wanted(args.engines, engines, out / args.model / "accuracy.json")
    folders = prepare_folder(config, args.model, out / ".work" / args.model,
                             [e for e in GENAI + LLAMACPP if e in wanted])
    prompts = trained_prompts(weights)
    step = build_model(config, "lm", weights=str(weights))
    print(f"transformers fp32: {len(prompts)} prompts, greedy {TRAINED_STEPS} tokens each", flush=True)
    refs = [tuple(t[0].numpy() for t in step.generate_greedy(torch.from_numpy(p), TRAINED_STEPS + 1)) for p in prompts]
    rows, grids = {}, {}
    for name, driver in _trained_drivers(folders, config, args.threads, wanted):
        rows[name] = accuracy.measure(driver, prompts, refs) | held(name, step, prompts, refs, config.vocab_size, grids) \
            if not isinstance(driver, str) else {"unavailable": driver}
        print(f"{name:14s} " + (f"unavailable: {driver}" if isinstance(driver, str) else _line(rows[name])), flush=True)
    doc = _kept({"model": args.model, "reference": "transformers fp32 (its own generate, greedy), same folder",
                 "prompts": [{"kind": p["kind"], "tokens": int(ids.shape[1])}
                             for p, ids in zip(prompt_file(), prompts)],
                 "decode_steps": TRAINED_STEPS, "tie": accuracy.TIE, "results": rows},
                out / args.model / "accuracy.json", engines, wanted, start)
    target = out / args.model
    target.mkdir(parents=True, exist_ok=True)
    (target / "accuracy.json").write_text(json.dumps(doc, indent=2) + "\n")
    (target / "accuracy.md").write_text(beside(target / "accuracy.json", doc, accuracy_markdown))
    print(f"wrote {target / 'accuracy.json'}, {target / 'accuracy.md'}")
    return 0


def held(name: str, model, prompts: list, refs: list, vocab_size: int, grids: dict) -> dict:
    """A quantized row's budget on this model: registry.GRID_RULE over what its scheme's grid costs `model` on the same
    prompts (export/grid_cost.py), measured once per scheme into `grids`; nothing for a float row or a peer. The report
    says whether the row is within it."""
    target = registry.TARGETS.get(LEVEL_0.get(name, name))
    if target is None or target.scheme is None:
        return {}
    from export.grid_cost import grid_figures
    if target.scheme.name not in grids:
        grids[target.scheme.name] = grid_figures(model, target.scheme, prompts, refs, vocab_size)
    grid = grids[target.scheme.name]
    return {"grid": grid, "budget": asdict(registry.GRID_RULE.budget(grid))}


def prompt_file() -> list[dict]:
    return json.loads(PROMPTS.read_text())["prompts"]


def trained_prompts(folder: Path) -> list[np.ndarray]:
    """The committed prompts as token ids [1, L] through the folder's tokenizer: chat messages in its chat template
    (the assistant's turn opened, as runtime.generate --chat does), prose and code as plain text (--prompt)."""
    tokenizer = load_tokenizer(folder)
    return [np.array([chat_ids(tokenizer, p["text"], str(folder)) if p["kind"] == "chat" else
                      prompt_ids(tokenizer, p["text"])]) for p in prompt_file()]


def _wanted(engines: list[str] | None, known: tuple, previous: Path) -> set[str]:
    """The engines to measure: all of `known`, or those named, which need the table `previous` to keep the rest of."""
    if not engines:
        return set(known)
    if unknown := [e for e in engines if e not in known]:
        raise ValueError(f"--engines: unknown engine(s) {unknown}; expected some of {', '.join(known)}")
    if not previous.exists():
        raise ValueError(f"--engines: {previous} does not exist, so there are no other rows to keep; run without "
                         "--engines first")
    return set(engines)


def _kept(doc: dict, previous: Path, order: tuple, wanted: set[str], start: dict) -> dict:
    """`doc`, in `order`, and where only some engines were `wanted`, the rows of `previous` it did not measure; each
    row's `measured`: this run or an earlier. Refuses to mix tables of other prompts or other decode steps, and a run
    whose code changed since it started (`start`, its stamp then)."""
    provenance.unchanged(start)
    run, old = provenance.stamp(), None
    rows = {name: dict(row, measured=run["date"]) for name, row in doc["results"].items()}
    if wanted != set(order):  # _wanted made sure `previous` exists
        old = json.loads(previous.read_text())
        if old["prompts"] != doc["prompts"] or old["decode_steps"] != doc["decode_steps"]:
            raise ValueError(f"{previous} was measured on other prompts or decode steps; expected the same table, "
                             "or a run without --engines")
        rows = {**old["results"], **rows}
    return provenance.keep(dict(doc, results={name: rows[name] for name in order if name in rows}), old, run)


def _trained_drivers(folders: dict, config, threads: int, wanted: set[str]):
    """(engine name, its driver, or why it could not be built here) for every engine of the table in `wanted`."""
    export = folders[next(k for k in folders if k in TRAINED)]
    exported = {g["target"] for g in load_manifest(export)["graphs"]}
    for target in (t for t in TRAINED_TARGETS if t in wanted):
        if LEVEL_0.get(target, target) not in exported:
            yield target, "not exported: python -m benchmarks exports the quantized targets " \
                f"{', '.join(TRAINED_QUANT)} of a trained model (see TRAINED_QUANT)"
            continue
        manifest = level_0(export, LEVEL_0[target]) if target in LEVEL_0 else None
        yield target, open_generator(export, LEVEL_0.get(target, target), manifest=manifest,
                                     provider="cpu", threads=threads)
    for peer in (p for p in GENAI if p in wanted):
        built = (folders[peer] / "genai_config.json").exists()
        yield peer, GenaiDriver(folders[peer], threads, max_length=config.capacity) if built else \
            "onnxruntime-genai is not installed"
    for engine in (e for e in LLAMACPP if e in wanted):
        yield engine, llamacpp.LlamaCppDriver(folders[engine], threads, config.capacity) if engine in folders else \
            folders["unavailable"].get(engine, "not built")


def level_0(export: Path, target: str) -> dict:
    """The export's manifest with the target's quantized graphs replaced by copies whose MatMulNBits run at accuracy
    level 0 (fp32 compute rather than int8 activations), written beside them once: the same quantized weights,
    read from the same weights file."""
    manifest = load_manifest(export)
    for g in (g for g in manifest["graphs"] if g["target"] == target and g.get("quantized")):
        copy = g["file"].replace(target, f"{target}-l0")
        if not (export / copy).exists():
            graph = onnx.load(export / g["file"], load_external_data=False)
            for node in (n for n in graph.graph.node if n.op_type == "MatMulNBits"):
                node.attribute.remove(next(a for a in node.attribute if a.name == "accuracy_level"))
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", 0))
            onnx.save(graph, export / copy)
        g["file"] = copy
    return manifest


def _line(r: dict) -> str:
    return ", ".join(f"{k} {r[k]:.3g}" for k in COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
