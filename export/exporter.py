"""Export one model to its prefill and decode graphs plus manifest.json, checked before publishing.

Each graph is exported, saved into a staging folder, verified (onnx.checker, static
shapes, parity against eager PyTorch), and only then moved into the output folder, with
the manifest last: a manifest on disk means its graphs passed.
"""
from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

import onnx
import onnx_ir as ir

import registry
from models import AttentionConfig, build_model, checksum, model_config
from models.checkpoint import folder_extras
from models.contract import STEPS, io_specs, npu_io_specs, step_len
from passes.leftovers import FUSED_OPS, unfused_attention
from passes.lint import lint
from passes.mixed_precision import float_share
from passes.model_io import save
from passes.pipeline import TARGETS, run_pipelines
from passes.static_shapes import check_static
from runtime.artifacts import open_generator
from runtime.drivers import HostCacheGenerator, mask_inputs
from runtime import accuracy
from runtime.metrics import Budget, dtype_tolerance, per_output, why_not
from runtime.parity import (TOLERANCE, SequenceReference, StepCase, compare_sequence, prefix_caches, reference_model,
                            sequence_reference, step_case, step_parity, worst)
from runtime.session import StepSession
from runtime.shared_weights import SharedWeights
from runtime.text import has_tokenizer

from .atomic import staged_dir, write_json
from .eager import EagerReferences, release_memory
from .grid_cost import grid_figures
from . import quantize, windows as ladders
from .manifest import attention_layers, build_manifest
from .progress import Progress
from .torch_export import DEFAULT_OPSET, cache_rows, to_onnx
from .weights_file import NAME as WEIGHTS_FILE, WeightsFile

class ParityError(AssertionError):
    """An exported graph computes something other than the eager model."""


class AccuracyError(ParityError):
    """A quantized model further from fp32 eager PyTorch on the accuracy prompt set than its scheme's budget."""


class LintError(ValueError):
    """An npu graph that NPU toolchains would reject."""


class FusionError(AssertionError):
    """A target graph with an attention left unfused."""


def parity_cases(config: AttentionConfig, step: str) -> list[int]:
    """Start positions that exercise an empty cache and the last rows of a full one."""
    t = step_len(config, step)
    return sorted({0, (config.capacity - t) // 2, config.capacity - t})


def export_model(config: AttentionConfig, out_dir: str | Path, kind: str = "attention", seed: int = 0,
                 weights: str | None = None, layer: int | None = None, opset: int = DEFAULT_OPSET,
                 name: str | None = None, targets: tuple[str, ...] = TARGETS, quant: tuple[str, ...] = (),
                 windows: tuple[int, ...] = (), log=print, bar: bool = False) -> dict:
    """Export, check and write the model's graphs. The whole model (`lm`) keeps its weights once, in one
    external-data file every graph points into; a Hugging Face folder as `weights` gives it its dims.
    `quant` adds a quantized target per scheme (export/quantize.py) beside the target it quantizes; `windows`
    (export/windows.py; default: the capacity alone) exports every step over each window of a ladder, all graphs
    then sharing the one weights file. `bar`: a progress bar on stderr (a terminal's), the lines of `log` above it."""
    out_dir = Path(out_dir)
    missing = [q for q in quant if registry.quantized_by(q).parent not in targets]
    if missing:
        raise quantize.QuantError(f"--quant {','.join(missing)} quantizes the "
                                  f"{'/'.join(sorted({registry.quantized_by(q).parent for q in missing}))} target, "
                                  "which is not exported")
    config = model_config(config, kind, weights)
    ladder = ladders.check(tuple(windows) or (config.capacity,), config)
    model = build_model(config, kind, seed, weights, layer)
    weights_info = {"source": weights or f"random(seed={seed})", "layer": layer, "checksum": checksum(model)}
    attention = attention_layers(model.attention_windows()) if kind == "lm" else None
    # the schemes a pass applies are exported with the float targets; the calibrated ones from their graphs after
    ort_targets = targets + tuple(quantize.target(q) for q in quant
                                  if registry.quantized_by(q).scheme.quantizer == "blocks")
    qdq = [q for q in quant if registry.quantized_by(q).scheme.quantizer == "qdq"]
    progress = Progress(len(ladder) * len(STEPS) * len(ort_targets) + len(qdq) * len(STEPS), log, bar)
    log = progress.log
    with staged_dir(out_dir) as tmp:
        eager = EagerReferences(tmp / ".eager")
        try:
            store = WeightsFile(tmp) if kind == "lm" or len(ladder) > 1 else None
            # 1. With the eager model: every graph made and saved, and every output of eager's that a check needs
            saved = _make_graphs(model, config, kind, seed, opset, ladder, ort_targets, tmp, store, eager, progress, log)
            with progress.stage("eager references"):
                # the capacity alone: what a target runs whose attention reads only the rows in use, and QDQ's
                eager.sequences = {w: _sequence_reference(model, config, kind, w, seed)
                                   for w in {ladder, (config.capacity,)}}
                if quant and kind == "lm":
                    prompts = accuracy.prompt_set(config)
                    reference = reference_model(model)  # an upcast copy of an fp16 model: made once
                    eager.accuracy = accuracy.references(reference, prompts, config)
                    eager.grid = {quantize.target(q): grid_figures(reference, registry.quantized_by(q).scheme,
                                                                   prompts, eager.accuracy, config.vocab_size)
                                  for q in quant}
            del model
            release_memory()
            # 2. Without it: each graph checked in onnxruntime against those outputs, then each target's sequence; a
            # target's sessions read one mapping of the weights file, dropped before the next target's
            graphs, sequence = [None] * len(saved), {}
            for target in ort_targets:
                shared = SharedWeights()
                for i, entry in ((i, e) for i, e in enumerate(saved) if e["target"] == target):
                    with progress.stage("checks"):
                        graphs[i] = _check_graph(entry, eager.cases(entry["window"], entry["step"]), config, kind, tmp,
                                                 shared, eager.grid.get(target))
                    progress.graph(_graph_line(graphs[i]))
                sequence[target] = _sequence_check(eager, config, graphs, target, tmp, shared, progress, log)
                del shared
                release_memory()
            for q in qdq:  # over C rows only: calibration is slow
                shared = SharedWeights()
                with progress.stage("calibration"):
                    graphs += _qdq_graphs(q, graphs, config, kind, tmp, store, eager, shared, progress, weights)
                target = quantize.target(q)
                sequence[target] = _sequence_check(eager, config, graphs, target, tmp, shared, progress, log)
                del shared
                release_memory()
            extras = {}
            if store is not None:
                weights_info |= {"file": WEIGHTS_FILE, "bytes": store.close()}
                extras = _lm_extras(weights, tmp)
            if attention is not None:
                extras["attention"] = attention
            if quant:
                with progress.stage("quantized accuracy"):
                    extras["quantization"] = _quantization(eager, config, kind, graphs, quant, tmp)
        finally:
            eager.close()
        manifest = build_manifest(config, kind, name or out_dir.name, opset, graphs, sequence, weights_info, extras, ladder)
        write_json(tmp / "manifest.json", manifest)
    log(f"wrote {out_dir}: {len(graphs)} graphs")
    if store is not None:
        log(f"wrote {out_dir / WEIGHTS_FILE} ({weights_info['bytes'] / 1e6:.1f} MB): every graph's weights, each stored once")
    first = next(g for g in graphs if g["step"] == "prefill" and g["window"] == config.capacity)
    shapes = ", ".join(f"{s['name']}{s['shape']}" for s in first["inputs"][:3])
    what = "token" if kind == "lm" else "sequence"
    log(f"wrote {out_dir / 'manifest.json'}: windows {'/'.join(map(str, ladder))}; "
        f"prefill inputs {shapes}{', ...' if len(first['inputs']) > 3 else ''}; "
        f"{what} parity (prompt {sequence[targets[0]]['prompt_len']} + {sequence[targets[0]]['decode_steps']} decode steps) "
        + ", ".join(f"{t} {sequence[t]['max_abs']:.1e}" + (f" (top-1 {sequence[t]['top1_agreement']:.0%})" if kind == "lm" else "")
                    for t in sequence))
    for t, q in manifest.get("lm", {}).get("quantization", {}).items():
        if "accuracy" in q:
            a = q["accuracy"]
            log(f"{t} accuracy vs fp32 eager ({len(a['prompts'])} prompts + {a['decode_steps']} steps): max rel "
                f"{a['max_rel']:.3f}, mean rel {a['mean_rel']:.3f}, KL {a['kl_mean']:.2e}, top-1 {a['top1']:.0%}, "
                f"greedy {a['greedy_match']:.0%}")
    log(progress.summary())
    return manifest


def _make_graphs(model, config: AttentionConfig, kind: str, seed: int, opset: int, ladder: tuple, targets: tuple,
                 tmp: Path, store: WeightsFile | None, eager: EagerReferences, progress: Progress, log) -> list[dict]:
    """Every step's graph per window and target, traced, rewritten and saved (checked as a graph: fusion, the onnx
    checker, static shapes, npu lint); eager's outputs for each window's step cases beside them. The entries still lack
    their parity (_check_graph)."""
    reference, saved = reference_model(model), []
    with progress.stage("eager references"):  # the cases' cache rows, for every window and step
        eager.keep_prefix(prefix_caches(reference, config, max(max(parity_cases(config.replace(capacity=w), s))
                                                                for w in ladder for s in STEPS), seed, kind))
    for step in STEPS:
        with progress.stage("trace"):
            traced = _tracer(model, config, step, opset, kind, ladder, log)
        pipeline = {t: t if _quantized(t, step) else registry.base(t) for t in targets}
        for window in ladder:
            with progress.stage("trace"):
                exported, pins = traced(window)
            with progress.stage("passes"):  # every target's passes, each prefix they share run once
                done = run_pipelines(exported, list(pipeline.values()), pins)
            cw = config.replace(capacity=window)
            with progress.stage("save"):
                saved += [_save(*done[pipeline[t]], cw, kind, step, t, tmp, store, ladders.suffix(window, config))
                          for t in targets]
            del exported, done
            release_memory()  # the passes' garbage (glibc keeps it in the heap), before the cases' caches join it
            with progress.stage("eager references"):
                for p0 in parity_cases(cw, step):
                    eager.add_case(window, step, step_case(reference, cw, step_len(cw, step), p0, seed, kind,
                                                           eager.prefix, own=model))
            release_memory()  # the cases' inputs and outputs, spilled to disk
            progress.made(len(targets), f"{step} over {window} rows: {len(targets)} graph(s) saved")
        del traced  # before the next step's trace: two traced graphs and a trace's garbage were 1 GB at 0.6B
        release_memory()
    return saved


def _graph_line(g: dict) -> str:
    """A checked graph as the log shows it: its size, parity, fusion and what each fusing pass did."""
    fusions = "; ".join(f"{p['pass']}: " + ", ".join(f"{v} {k}" for k, v in p["stats"].items())
                        for p in g["passes"] if p["pass"] not in ("cleanup", "upgrade_opset") and any(p["stats"].values()))
    return (f"{g['file']} ({g['bytes'] / 1e6:.1f} MB): parity vs eager max rel {g['parity']['max_rel']:.1e}"
            + (f", attention fused {g['attention_fused']}" if registry.target(g["target"]).fuses else "")
            + (f" | {fusions}" if fusions else ""))


def _quantized(target: str, step: str) -> bool:
    """Whether `target` runs its own graph for `step`: every plain target does; a quantized one only for the steps its
    scheme quantizes (the others run the base target's graph)."""
    scheme = registry.target(target).scheme
    return not scheme or step in scheme.quantized_steps


def _tracer(model, config: AttentionConfig, step: str, opset: int, kind: str, ladder: tuple, log):
    """window -> (the step's graph over that many cache rows, the dims fix_dims pins to make it so). A ladder is traced
    once, over a symbolic number of rows pinned per window; a model whose code torch.export cannot trace that way
    (or a single window) is traced per window."""
    t = step_len(config, step)
    if len(ladder) > 1:
        try:
            traced = to_onnx(model, config, t, opset, kind, any_window=True)
            if rows := cache_rows(traced):
                return lambda window: (traced, {rows: window})
            why = "torch.export made the cache rows a number"
        except Exception as e:  # noqa: BLE001 -- any failure of the symbolic trace falls back to the static one
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        log(f"{step}: traced once per window, not once for the ladder ({why})")
    return lambda window: (to_onnx(model, config.replace(capacity=window), t, opset, kind), None)


def _qdq_graphs(scheme: str, graphs: list[dict], config: AttentionConfig, kind: str, tmp: Path,
                store: WeightsFile | None, eager: EagerReferences, shared: SharedWeights, progress: Progress,
                weights: str | None) -> list[dict]:
    """The npu graphs over C rows in QDQ form, their activation ranges recorded by running the float npu graphs just
    written (and, for a whole model from a folder with a tokenizer, text through it); each saved and checked as the
    others."""
    made = registry.quantized_by(scheme)
    floats = {g["step"]: g for g in graphs if g["target"] == made.parent and g["window"] == config.capacity}
    sessions = [StepSession(tmp / floats[step]["file"], floats[step]["inputs"], floats[step]["outputs"],
                            provider="cpu", weights=shared) for step in STEPS]
    text = Path(weights) if kind == "lm" and weights is not None and has_tokenizer(weights) else None
    driver = HostCacheGenerator(*sessions, made.mask_value)
    inputs = quantize.calibration_inputs(config, kind, text=text)
    out = []
    for step in STEPS:
        float_graph = ir.external_data.load_to_model(ir.load(tmp / floats[step]["file"]))  # qdq() saves it elsewhere
        qdq, feeds, floats_kept = quantize.qdq(float_graph, quantize.step_feeds(driver, inputs, kind, step), made.opset)
        rules, share = Counter(r["rule"] for r in floats_kept.values()), float_share(qdq)
        entry = {"pass": "quantize_qdq", "summary": f"quantize_qdq: {scheme}, {feeds} calibration feeds, "
                                                    f"{len(floats_kept)} activation(s) kept float ("
                                                    + (", ".join(f"{n} {r}" for r, n in sorted(rules.items())) or "none")
                                                    + f"), {share['float_weights']:.1%} of matmul weights float",
                 "stats": {"quantize_linear": sum(n.op_type == "QuantizeLinear" for n in qdq.graph),
                           "float_activations": len(floats_kept)} | {f"float_{r}": n for r, n in rules.items()},
                 "not_matched": [], "float_activations": list(floats_kept), "float_share": share}
        report = {"passes": floats[step]["passes"] + [entry]}
        saved = _save(qdq, report, config, kind, step, made.name, tmp, store)
        progress.made(1, f"{saved['file']}: calibrated on {feeds} feeds, saved")
        out.append(_check_graph(saved, eager.cases(config.capacity, step), config, kind, tmp, shared,
                                eager.grid.get(made.name)))
        progress.graph(_graph_line(out[-1]))
        out[-1]["calibration"] = {"method": "MinMax", "feeds": feeds,
                                  "inputs": (f"{len(inputs) - quantize.CALIBRATION_PROMPTS} prompts of text through "
                                             f"the folder's tokenizer (export/quantize.py), then " if text else "")
                                            + f"{quantize.CALIBRATION_PROMPTS} seeded random prompts "
                                            f"({'token ids' if kind == 'lm' else 'hidden states'}: "
                                            f"{quantize.FIRST_TOKEN_PROMPTS} of one token, the last filling the cache), "
                                            f"each read as a prompt "
                                            f"then {quantize.CALIBRATION_DECODE_STEPS} decode steps"
                                            + (" of the model's own greedy tokens" if kind == "lm" else "")}
    return out


def _save(graph: ir.Model, report: dict, config: AttentionConfig, kind: str, step: str, target: str, tmp: Path,
          store: WeightsFile | None, suffix: str = "") -> dict:
    """Save the target's graph over `config.capacity` rows (named with `suffix`), checked as a graph: every attention
    fused, the onnx checker, static shapes, npu lint."""
    entry, host = registry.target(target), registry.target(target).cache == registry.HOST
    what = f"{step}.{target}{suffix}"
    fused = _check_fused(graph, report, entry, config.num_layers if kind == "lm" else 1, what)
    path = tmp / f"{what}.onnx"
    if store is not None:
        store.externalize(graph)
        ir.save(graph, path)
        data = WEIGHTS_FILE
    else:
        data = save(graph, path)
    if not entry.contrib:  # onnxruntime's contrib ops are not in ONNX's schema registry; ORT loads them below
        onnx.checker.check_model(str(path), full_check=True)
    check_static(path, strict=not entry.contrib)
    if host and (violations := lint(path, target)):  # the NPU toolchains' rules
        rules = ", ".join(f"{r} ({n})" for r, n in Counter(v.rule for v in violations).items())
        first = {v.rule: v for v in reversed(violations)}
        raise LintError(f"{path.name}: {len(violations)} npu lint violation(s): {rules}; e.g. "
                        + "; ".join(f"{v.rule}: {v.node} ({v.op}): {v.message}" for v in first.values()))
    t = step_len(config, step)
    io = npu_io_specs(config, t, kind, tuple(mask_inputs(v.name for v in graph.graph.inputs))) if host \
        else io_specs(config, t, kind)
    return {"step": step, "target": target, "window": config.capacity, "file": path.name, "external_data": data,
            "bytes": path.stat().st_size + ((tmp / data).stat().st_size if data and store is None else 0),
            "cache_in_place": entry.in_place, "attention_fused": fused, **io,
            **({"host_cache": {"mask_value": entry.mask_value}} if host else {}),
            **({"quantized": _quantized(target, step)} if entry.scheme else {}),
            "passes": report["passes"]}


def _check_graph(saved: dict, cases: Iterable[StepCase], config: AttentionConfig, kind: str, tmp: Path,
                 shared: SharedWeights, grid: dict | None = None) -> dict:
    """The saved graph's step parity in onnxruntime against eager's `cases`: its manifest entry, or ParityError.
    `grid`: what the target's scheme's grid costs the model (export/grid_cost.py), for a quantized graph's budget."""
    step, target, path = saved["step"], saved["target"], tmp / saved["file"]
    config = config.replace(capacity=saved["window"])
    session = StepSession(path, saved["inputs"], saved["outputs"], provider="cpu", weights=shared)
    runner = HostCacheGenerator(session, session, saved["host_cache"]["mask_value"]) if "host_cache" in saved else session
    # The caches hold eager's rows for a real prefix (runtime/parity.step_case): a quantized graph's ranges were
    # calibrated on real rows too (tiny w8a16 decode measured 0.42 on random rows, 0.09 on prefilled ones).
    # An fp16 model is held, case by case and output by output, to what fp16 costs it there in eager PyTorch
    # (metrics.fp16_tolerance), and its logits to eager's argmax where eager decides it (metrics.decided_rows).
    results = []
    for case in cases:
        measured = step_parity(case, runner, config)
        outputs = list(measured["per_output"])
        drifts = case.drift or (None,) * len(outputs)
        held = {name: _budget(config, target, d, case.decided is not None and i == 0, grid, step)
                for i, (name, d) in enumerate(zip(outputs, drifts))}
        results.append(measured | {"tolerance": max(b.max_rel for b in held.values()), "held": held,
                                   "eager_fp16_max_rel": case.drift})
        if missed := per_output(measured["per_output"], held):
            name, why = missed
            raise ParityError(f"{path.name}: step parity against fp32 eager PyTorch: {why} ({name}, p0={case.p0}); "
                              f"expected {quantize.spell(held[name])}")
    err = worst(results)
    parity = {"reference": "eager PyTorch, fp32", "tolerance": max(r["tolerance"] for r in results), **err,
              "caches": "rows before p0 eager's own, from a random prefix",
              "cases": [{k: c[k] for k in ("p0", "max_abs", "max_rel", "tolerance")} | _per_output(c)
                        for c in results]}
    return {**{k: v for k, v in saved.items() if k != "passes"}, "parity": parity, "passes": saved["passes"]}


def _per_output(case: dict) -> dict:
    """An fp16 case's per-output record for the manifest: each output's max_rel, budget and eager fp16 max_rel."""
    if case["eager_fp16_max_rel"] is None:
        return {}
    return {"eager_fp16_max_rel": max(case["eager_fp16_max_rel"]),
            "outputs": {name: {"max_rel": err["max_rel"], "tolerance": case["held"][name].max_rel,
                               "eager_fp16_max_rel": drift} | ({"swapped": err["swapped"]} if "swapped" in err else {})
                        for (name, err), drift in zip(case["per_output"].items(), case["eager_fp16_max_rel"])}}


def _lm_extras(weights: str | None, tmp: Path) -> dict:
    """End-of-sequence ids of a Hugging Face folder, and its tokenizer files (tokenizer.json, tokenizer_config.json, the
    chat template, ...) and generation_config.json copied beside the graphs: the export folder is what
    `runtime.generate --chat/--prompt` loads, as transformers resolves it (runtime/text.py, save_text)."""
    from runtime.text import TOKENIZER_FILES, save_text
    if weights is None or not Path(weights).is_dir():
        return {"eos_token_ids": []}
    found = folder_extras(weights)
    copied = [name for name in TOKENIZER_FILES if (Path(weights) / name).is_file()]
    for name in copied:
        shutil.copyfile(Path(weights) / name, tmp / name)
    return {"eos_token_ids": found["eos_token_ids"], "tokenizer": "tokenizer.json" if found["tokenizer"] else None,
            "tokenizer_files": copied, "text": save_text(weights, tmp) if copied else None}


def _check_fused(graph: ir.Model, report: dict, target: registry.Target, layers: int, what: str) -> str:
    """'L/L': every layer's attention is one fused op (lowered, for a host-cache target); a target that fuses nothing
    keeps them ('0/L')."""
    if not target.fuses:
        return f"0/{layers}"
    if target.cache == registry.HOST:
        done = sum(p["stats"].get("attention", 0) for p in report["passes"] if p["pass"] == "lower_npu")
        why = [n["reason"] for p in report["passes"] if p["pass"] == "lower_npu" for n in p["not_matched"]]
    else:
        done = sum((n.domain, n.op_type) in FUSED_OPS for n in graph.graph)
        why = [x["reason"] for x in unfused_attention(graph, report["passes"])]
    if done != layers or why:
        raise FusionError(f"{what}: attention fused in {done} of {layers} layer(s): {'; '.join(why) or 'no reason given'}")
    return f"{done}/{layers}"


def _sequence_plan(config: AttentionConfig, ladder: tuple) -> tuple[int, int]:
    """(prompt length, decode steps) of a sequence check over `ladder`: a prompt over one chunk, then up to 16 decode
    steps; over a ladder the prompt ends a few rows before the last switch, so its chunks cross every smaller window's
    end and the decode steps cross the last."""
    decode_steps = min(16, config.capacity // 2)
    prompt_len = min(config.capacity - decode_steps, config.chunk + config.chunk // 2 + 1)
    if len(ladder) > 1:
        prompt_len = min(max(prompt_len, ladder[-2] - decode_steps // 2), config.capacity - decode_steps)
    return prompt_len, decode_steps


def _sequence_reference(model, config: AttentionConfig, kind: str, ladder: tuple, seed: int) -> SequenceReference:
    return sequence_reference(model, config, *_sequence_plan(config, ladder), seed, kind)


def _sequence_check(eager: EagerReferences, config: AttentionConfig, graphs: list[dict], target: str, tmp: Path,
                    shared: SharedWeights, progress: Progress, log) -> dict:
    with progress.stage("sequence parity"):
        seq = _sequence_parity(eager.sequences, config, [g for g in graphs if g is not None], target, tmp, shared,
                               eager.grid.get(target))
    release_memory()  # the driver's sessions and caches (a driver holds reference cycles)
    log(f"{target}: sequence parity {seq['max_rel']:.1e} ({progress.elapsed():.0f} s)")
    return seq


def _sequence_parity(references: dict, config: AttentionConfig, graphs: list[dict], target: str, tmp: Path,
                     shared: SharedWeights, grid: dict | None = None) -> dict:
    """The target's driver over its window ladder against the full-sequence forward planned for that ladder."""
    driver = _driver(config, graphs, target, tmp, weights=shared)
    reference = references[tuple(driver.windows)]
    seq = compare_sequence(reference, driver)
    held = _budget(config, target, reference.drift, reference.decided is not None, grid)
    _check(seq, held, f"{target}: sequence parity (against the full-sequence forward)")
    return {**seq, "windows": driver.windows, "tolerance": held.max_rel,
            **({"eager_fp16_max_rel": reference.drift} if reference.drift is not None else {})}


def _driver(config: AttentionConfig, graphs: list[dict], target: str, tmp: Path, **session_options):
    """The runtime's driver over the target's graphs just written, as a user opens them (every window)."""
    return open_generator(tmp, target, manifest={"graphs": graphs, "config": config.to_dict()}, provider="cpu",
                          **session_options)


def _budget(config: AttentionConfig, target: str, drift: float | None = None, logits: bool = False,
            grid: dict | None = None, step: str | None = None) -> Budget:
    """What an output of a step (`step`) or a sequence of `target` is held to: the dtype's tolerance (fp16's following
    `drift`, what fp16 costs the model on that output in eager PyTorch on the same inputs), or for a step its scheme
    quantizes, or a sequence, the scheme's step budget (following `grid`, what the scheme's grid costs the model); a
    float target's `logits` (measured in fp16: decided rows known) also to eager's argmax on the rows eager decides."""
    float_tolerance = dtype_tolerance(config.dtype, drift)
    if step is not None and not _quantized(target, step):  # the base target's graph, saved under this target's name
        return replace(Budget(float_tolerance), decided=logits)
    held = quantize.step_budget(quantize.budget(target, float_tolerance, grid))
    return replace(held, decided=logits and registry.target(target).scheme is None)


def _check(err: dict, budget: Budget, what: str, error: type[ParityError] = ParityError) -> None:
    """Raise `error` naming `what`, the measure that missed and the budget, unless `err` is within `budget`."""
    if why := why_not(err, budget):
        raise error(f"{what} against fp32 eager PyTorch: {why}; expected {quantize.spell(budget)}")


def _quantization(eager: EagerReferences, config: AttentionConfig, kind: str, graphs: list[dict], quant: tuple,
                  tmp: Path) -> dict:
    """Each quantized target's scheme and, for the whole model, its accuracy (runtime/accuracy.py) on one prompt set
    against eager's references of it, held to the scheme's whole budget (max_rel, KL, top-1) on this model: the
    registry's rule over what the scheme's grid costs it (`grid`)."""
    found = {quantize.target(q): quantize.describe(q) for q in quant}
    if kind != "lm":
        return found
    prompts = accuracy.prompt_set(config)
    for target in found:
        measured = accuracy.measure(_driver(config, graphs, target, tmp, weights=SharedWeights()), prompts,
                                    eager.accuracy)
        release_memory()
        held = quantize.budget(target, TOLERANCE[config.dtype], eager.grid[target])
        _check(measured, held, f"{target}: accuracy on the prompt set", AccuracyError)
        found[target] |= {"grid": eager.grid[target], "budget": asdict(held),
                          "accuracy": {"reference": "eager PyTorch fp32", **measured}}
    return found
