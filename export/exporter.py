"""Export one model to its prefill and decode graphs plus manifest.json, checked before publishing.

Each graph is exported, saved into a staging folder, verified (onnx.checker, static
shapes, parity against eager PyTorch), and only then moved into the output folder, with
the manifest last: a manifest on disk means its graphs passed.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import onnx_ir as ir

from models import AttentionConfig, build_model, checksum, model_config
from models.checkpoint import folder_extras
from models.contract import STEPS, io_specs, npu_io_specs, step_len
from passes.leftovers import FUSED_OPS, unfused_attention
from passes.lint import lint
from passes.lower_npu import MASK_VALUE
from passes.model_io import save
from passes.pipeline import TARGETS, run_pipeline
from passes.static_shapes import check_static
from runtime.drivers import Generator, HostCacheGenerator
from runtime.parity import TOLERANCE, sequence_parity, step_parity, token_parity, within, worst
from runtime.session import StepSession

from .atomic import staged_dir, write_json
from .manifest import build_manifest
from .torch_export import DEFAULT_OPSET, to_onnx
from .weights_file import NAME as WEIGHTS_FILE, WeightsFile

# Graphs whose cache write (TensorScatter, GroupQueryAttention) onnxruntime runs in place when
# past and present are bound to one buffer; ScatterElements makes no such promise.
IN_PLACE_TARGETS = ("onnx", "ort")


class ParityError(AssertionError):
    """An exported graph computes something other than the eager model."""


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
                 name: str | None = None, targets: tuple[str, ...] = TARGETS, log=print) -> dict:
    """Export, check and write the model's graphs. The whole model (`lm`) keeps its weights once, in one
    external-data file every graph points into; a Hugging Face folder as `weights` gives it its dims."""
    out_dir = Path(out_dir)
    config = model_config(config, kind, weights)
    model = build_model(config, kind, seed, weights, layer)
    graphs, sequence = [], {}
    with staged_dir(out_dir) as tmp:
        store = WeightsFile(tmp) if kind == "lm" else None
        for step in STEPS:
            exported = to_onnx(model, config, step_len(config, step), opset, kind)
            for target in targets:
                graphs.append(_build_graph(model, config, kind, exported, step, target, tmp, seed, store))
        weights_info = {"source": weights or f"random(seed={seed})", "layer": layer, "checksum": checksum(model)}
        extras = {}
        if store is not None:
            weights_info |= {"file": WEIGHTS_FILE, "bytes": store.close()}
            extras = _lm_extras(weights, tmp)
        for target in targets:
            sequence[target] = _sequence_parity(model, config, kind, graphs, target, tmp, seed)
        manifest = build_manifest(config, kind, name or out_dir.name, opset, graphs, sequence, weights_info, extras)
        write_json(tmp / "manifest.json", manifest)
    for g in graphs:
        fusions = "; ".join(f"{p['pass']}: " + ", ".join(f"{v} {k}" for k, v in p["stats"].items())
                            for p in g["passes"] if p["pass"] not in ("cleanup", "upgrade_opset") and any(p["stats"].values()))
        log(f"wrote {out_dir / g['file']} ({g['bytes'] / 1e6:.1f} MB): parity vs eager max abs {g['parity']['max_abs']:.1e}"
            + (f", attention fused {g['attention_fused']}" if g["target"] != "raw" else "") + (f" | {fusions}" if fusions else ""))
    if store is not None:
        log(f"wrote {out_dir / WEIGHTS_FILE} ({weights_info['bytes'] / 1e6:.1f} MB): every graph's weights, each stored once")
    shapes = ", ".join(f"{s['name']}{s['shape']}" for s in graphs[0]["inputs"][:3])
    what = "token" if kind == "lm" else "sequence"
    log(f"wrote {out_dir / 'manifest.json'}: prefill inputs {shapes}{', ...' if len(graphs[0]['inputs']) > 3 else ''}; "
        f"{what} parity (prompt {sequence[targets[0]]['prompt_len']} + {sequence[targets[0]]['decode_steps']} decode steps) "
        + ", ".join(f"{t} {sequence[t]['max_abs']:.1e}" + (f" (top-1 {sequence[t]['top1_agreement']:.0%})" if kind == "lm" else "")
                    for t in targets))
    return manifest


def _build_graph(model, config: AttentionConfig, kind: str, exported: ir.Model, step: str, target: str, tmp: Path,
                 seed: int, store: WeightsFile | None) -> dict:
    """Run the target's passes on a copy of the exported graph, save it, and check it before it counts."""
    graph = ir.serde.deserialize_model(ir.serde.serialize_model(exported))
    report = run_pipeline(graph, target)
    fused = _check_fused(graph, report, target, config.num_layers if kind == "lm" else 1, f"{step}.{target}")
    path = tmp / f"{step}.{target}.onnx"
    if store is not None:
        store.externalize(graph)
        ir.save(graph, path)
        data = WEIGHTS_FILE
    else:
        data = save(graph, path)
    if target != "ort":  # onnxruntime's contrib ops are not in ONNX's schema registry; ORT loads them below
        onnx.checker.check_model(str(path), full_check=True)
    check_static(path, strict=target != "ort")
    if target == "npu" and (violations := lint(path, "npu")):
        raise LintError(f"{path.name}: {len(violations)} npu lint violation(s), e.g. {violations[0]}")
    t = step_len(config, step)
    io = npu_io_specs(config, t, kind) if target == "npu" else io_specs(config, t, kind)
    session = StepSession(path, io["inputs"], io["outputs"], provider="cpu")
    runner = HostCacheGenerator(session, session, MASK_VALUE) if target == "npu" else session
    cases = [step_parity(model, runner, config, t, p0, seed, kind) for p0 in parity_cases(config, step)]
    err = worst(cases)
    if not within(err, config.dtype):
        raise ParityError(f"{path.name}: max error {err} against eager PyTorch; expected within {TOLERANCE[config.dtype]}")
    return {"step": step, "target": target, "file": path.name, "external_data": data,
            "bytes": path.stat().st_size + ((tmp / data).stat().st_size if data and store is None else 0),
            "cache_in_place": target in IN_PLACE_TARGETS, "attention_fused": fused, **io,
            **({"host_cache": {"mask_value": MASK_VALUE}} if target == "npu" else {}),
            "parity": {"reference": "eager PyTorch, fp32", "tolerance": TOLERANCE[config.dtype], **err,
                       "cases": [{k: c[k] for k in ("p0", "max_abs", "max_rel")} for c in cases]},
            "passes": report["passes"]}


def _lm_extras(weights: str | None, tmp: Path) -> dict:
    """End-of-sequence ids and the tokenizer (copied beside the graphs) of a Hugging Face folder."""
    if weights is None or not Path(weights).is_dir():
        return {"eos_token_ids": []}
    found = folder_extras(weights)
    if found["tokenizer"] is not None:
        shutil.copyfile(found["tokenizer"], tmp / "tokenizer.json")
    return {"eos_token_ids": found["eos_token_ids"], "tokenizer": "tokenizer.json" if found["tokenizer"] else None}


def _check_fused(graph: ir.Model, report: dict, target: str, layers: int, what: str) -> str:
    """'L/L': every layer's attention is one fused op (lowered, for npu); raw graphs keep theirs ('0/L')."""
    if target == "raw":
        return f"0/{layers}"
    if target == "npu":
        done = sum(p["stats"].get("attention", 0) for p in report["passes"] if p["pass"] == "lower_npu")
        why = [n["reason"] for p in report["passes"] if p["pass"] == "lower_npu" for n in p["not_matched"]]
    else:
        done = sum((n.domain, n.op_type) in FUSED_OPS for n in graph.graph)
        why = [x["reason"] for x in unfused_attention(graph, report["passes"])]
    if done != layers or why:
        raise FusionError(f"{what}: attention fused in {done} of {layers} layer(s): {'; '.join(why) or 'no reason given'}")
    return f"{done}/{layers}"


def _sequence_parity(model, config: AttentionConfig, kind: str, graphs: list[dict], target: str, tmp: Path,
                     seed: int) -> dict:
    sessions = {g["step"]: StepSession(tmp / g["file"], g["inputs"], g["outputs"], provider="cpu",
                                       cache_in_place=g["cache_in_place"])
                for g in graphs if g["target"] == target}
    driver = HostCacheGenerator(sessions["prefill"], sessions["decode"], MASK_VALUE) if target == "npu" \
        else Generator(sessions["prefill"], sessions["decode"])
    decode_steps = min(16, config.capacity // 2)  # a prompt over one chunk, then up to 16 decode steps
    prompt_len = min(config.capacity - decode_steps, config.chunk + config.chunk // 2 + 1)
    check = token_parity if kind == "lm" else sequence_parity
    seq = check(model, driver, config, prompt_len=prompt_len, decode_steps=decode_steps, seed=seed)
    if not within(seq, config.dtype):
        raise ParityError(f"{target}: sequence parity max error {seq} against the eager full-sequence forward")
    return seq
