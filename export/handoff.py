"""make handoff: a self-checking bundle for NPU toolchains, in artifacts/<name>/handoff/.

For the attention block and the decoder block: the `npu` graphs in fp32 and fp16 and the
`onnx` graphs in fp32 (each with the export's own manifest), golden vectors, the lint report,
which ops each runtime refuses per target (measured by running the golden vectors), and a README
for the receiving engineer. The whole model (`lm`) adds its `npu` graphs in fp32 and fp16 (and
quantized). Each window's goldens run one random sequence (golden_positions): prefill chunks at
0, at T over the first chunk's rows and at the window's end; decode steps right after the first
chunk and at the window's last row, so every graph reads a non-empty cache up to its window's
depth. The npu graphs' goldens hold only the cache rows no earlier step of the golden wrote: the
verifier keeps the caches as a host would, writing each step's reference rows.
`python -m runtime.verify BUNDLE` re-checks it from the bundle alone.
"""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import torch

import registry
from models import AttentionConfig, build_model, model_config, preset
from models.lm import greedy
from models.contract import cache_names, input_names, output_names
from passes.lint import lint
from runtime import qnn
from runtime.qnn_binary import binary_info, check_wrapper
from runtime.drivers import host_mask
from runtime.cli import Parser, run
from runtime.metrics import FP16_CAP, FP16_HEADROOM, TOLERANCE, decided_rows, dtype_tolerance, error, logit_error
from runtime.parity import reference_model
from runtime import verify
from runtime.text import chat_ids, has_tokenizer, load_tokenizer
from runtime.verify import FORMAT, available_runtimes, named, verify_graph

from . import quantize, windows as ladders
from .atomic import staged_dir
from .exporter import export_model
from .progress import Progress



def variants() -> dict[str, tuple]:
    """Per kind: ((dtype, targets), ...), the targets the registry bundles for that kind and dtype; a quantized target
    shares its float graph's folder and weights file."""
    pairs = {pair for t in registry.TARGETS.values() for pair in t.bundled}
    kinds = dict.fromkeys(k for k in KINDS if any(k == kind for kind, _ in pairs))
    return {k: tuple((d, tuple(n for n, t in registry.TARGETS.items() if (k, d) in t.bundled))
                     for d in TOLERANCE if (k, d) in pairs) for k in kinds}


KINDS = ("attention", "block", "lm")
DECODE_STEPS = 4  # right after the first prefill chunk; the decode goldens add one at the window's last row
MASK_VALUE = registry.NPU_MASK_VALUE  # the npu graphs' (the bundle README's prose speaks of them)
CHAT, GREEDY_TOKENS = "What is the capital of France?", 32  # the whole model's answer each runtime gives, in README


def golden_positions(config: AttentionConfig) -> dict[str, list[tuple[int, int]]]:
    """(p0, rows) of each golden step over a window of config.capacity rows: prefill chunks at 0, at T (over a
    non-empty cache) and ending at the window's last row; decode steps right after the first chunk, then one at
    the window's last row (reading every row before it)."""
    t, w = config.chunk, config.capacity
    return {"prefill": [(p0, t) for p0 in sorted({0, t, w - t})],
            "decode": [(t + i, 1) for i in range(DECODE_STEPS)] + [(w - 1, 1)]}


def least_window(config: AttentionConfig) -> int:
    """The smallest window golden_positions fits: two prefill chunks, and decode steps after the first and past them."""
    return max(2 * config.chunk, config.chunk + DECODE_STEPS + 1)


def _sequence(config: AttentionConfig, kind: str, seed: int) -> torch.Tensor:
    """The goldens' random sequence over the window: token ids for the lm, hidden states (as config.dtype holds them)
    else."""
    gen, b, w = torch.Generator().manual_seed(seed), config.batch, config.capacity
    if kind == "lm":
        return torch.randint(0, config.vocab_size, (b, w), generator=gen)
    return torch.randn(b, w, config.hidden_size, generator=gen).to(config.torch_dtype).float()


def fp16_drift(config: AttentionConfig, kind: str, seed: int, weights: str | None) -> dict[str, float]:
    """What fp16 costs the model in eager PyTorch: the goldens' sequence over the window in one forward with the model
    in fp16 against one in fp32, max_rel per output (logits or hidden states, and each cache), by the step contract's
    output names."""
    x, w = _sequence(config, kind, seed), config.capacity
    outs = []
    for dtype in ("fp32", "fp16"):
        c = config.replace(dtype=dtype)
        model = build_model(c, kind, seed, weights).eval()
        empty = [torch.zeros(c.batch, c.num_kv_heads, w, c.head_dim, dtype=c.torch_dtype)
                 for _ in input_names(c, kind)[2:]]
        with torch.no_grad():
            outs.append(model(x if kind == "lm" else x.to(c.torch_dtype), torch.arange(w).expand(c.batch, w), *empty))
        del model
    return {name: error(h.float().numpy(), f.numpy())["max_rel"]
            for name, h, f in zip(output_names(config, kind), outs[1], outs[0])}


def golden(model, config: AttentionConfig, target: str, kind: str = "attention", seed: int = 0,
           half: torch.nn.Module | None = None) -> tuple[dict[str, list], dict[str, float | None]]:
    """Per step graph: [(inputs, eager outputs, rows written)] at golden_positions, all of one random sequence over
    the window (token ids for the lm, hidden states else). Each step reads the cache a host holds: eager's rows of
    the sequence before the golden's first step (or before a step past the rows written so far), then each step's
    own rows. The npu goldens store only those first rows (the verifier's host cache writes each step's), the others
    their present caches' rows written so far alone (the verifier compares no others).
    `half`: the model in fp16, run on every golden too: per step graph, {output: the worst max_rel it measures against
    eager fp32 there} (what fp16 costs the model on those inputs: metrics.fp16_tolerance), else None."""
    reference, np_dtype = reference_model(model), "float16" if config.dtype == "fp16" else "float32"
    b, w, lm, npu = config.batch, config.capacity, kind == "lm", registry.target(target).cache == registry.HOST
    x = _sequence(config, kind, seed)
    names, outs = input_names(config, kind), output_names(config, kind)
    ids = "int32" if npu else "int64"
    # The npu goldens store the rows a host cache starts from in fp16 (a window's deepest steps start from about W rows
    # per layer: fp16 halves the file); the verifier widens them, and eager reads them so too.
    held_dtype = "float16" if npu else np_dtype
    empty = [torch.zeros(b, config.num_kv_heads, w, config.head_dim) for _ in names[2:]]
    with torch.no_grad():
        rows = [_held(r, held_dtype) for r in reference(x, torch.arange(w).expand(b, w), *empty)[1:]]
    steps, drift = {}, {}
    for step, at in golden_positions(config).items():
        steps[step], host, held = [], [e.clone() for e in empty], 0  # the host's cache and the rows it holds
        drift[step] = None if half is None else {}
        for p0, n in at:
            if p0 > held:
                for h, r in zip(host, rows):
                    h[:, :, :p0] = r[:, :, :p0]
            cache = [torch.cat([h[:, :, :p0], e[:, :, p0:]], dim=2) for h, e in zip(host, empty)]  # rows before p0
            pos = (p0 + torch.arange(n)).expand(b, n)
            with torch.no_grad():
                out, *presents = reference(x[:, p0:p0 + n], pos, *cache)
            feeds = {names[0]: x[:, p0:p0 + n].numpy().astype(ids if lm else np_dtype), "position_ids": pos.numpy().astype(ids)}
            want = {outs[0]: out.numpy()}
            if npu:
                feeds["attention_mask"] = host_mask(b, w, p0, n, registry.target(target).mask_value, np_dtype)
                want |= {new: p[:, :, p0:p0 + n].numpy() for new, p in zip(cache_names(config, kind, ""), presents)}
            else:
                want |= {name: p[:, :, :p0 + n].numpy() for name, p in zip(outs[1:], presents)}
            decided = None
            if half is not None:
                errs, got = _half_error(half, x[:, p0:p0 + n], pos, cache, out, presents, p0, lm)
                drift[step] = {k: max(drift[step].get(k, 0.0), e) for k, e in zip(want, errs)}
                decided = decided_rows(out.numpy(), got) if lm else None
            if not npu:
                feeds |= {name: c.numpy().astype(np_dtype) for name, c in zip(names[2:], cache)}
            elif p0 > held:
                feeds |= {name: c[:, :, :p0].numpy().astype(held_dtype) for name, c in zip(names[2:], cache)}
            for h, p in zip(host, presents):  # as the graph's dtype holds them
                h[:, :, p0:p0 + n] = _held(p[:, :, p0:p0 + n], np_dtype)
            held = max(held, p0 + n)
            steps[step].append((feeds, want, p0 + n, decided))
    return steps, drift


def _half_error(half, x, pos, cache, out, presents, p0: int, lm: bool) -> tuple[list[float], np.ndarray]:
    """max_rel of the fp16 model's step against eager fp32's, per output (its output, then the cache rows it writes),
    and its output."""
    n = x.shape[1]
    with torch.no_grad():
        got, *rows = half(x if lm else x.half(), pos, *[c.half() for c in cache])
    errs = [(logit_error if lm else error)(got.float().numpy(), out.numpy())]
    errs += [error(r[:, :, p0:p0 + n].float().numpy(), p[:, :, p0:p0 + n].numpy()) for r, p in zip(rows, presents)]
    return [e["max_rel"] for e in errs], got.float().numpy()


def _held(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """`t` as a buffer of numpy dtype `dtype` holds it, in fp32 for eager."""
    return t.to(getattr(torch, dtype)).float()


def _goldens(model, config: AttentionConfig, kind: str, target: str, folder: str, suffix: str, seed: int,
             tmp: Path, exported: dict, half: torch.nn.Module | None) -> list[dict]:
    """The bundle entries (and golden files) of one target's two step graphs over `config.capacity` rows; `exported`:
    the manifest they come from; `half`: golden's. An fp16 graph's outputs are each held to what fp16 costs the model
    on that output on its goldens (fp16_tolerance of its eager_fp16_max_rel), as the export held it on its cases."""
    entries, scheme, grid = [], registry.target(target).scheme, quantize.grid_of(exported, target)
    goldens, drifts = golden(model, config, target, kind, seed, half)
    for step, steps in goldens.items():
        name = f"{folder}/{step}.{target}{suffix}"
        save_golden(tmp / f"{name}.golden.npz", steps)
        entries.append({"file": f"{name}.onnx", "golden": f"{name}.golden.npz", "kind": kind, "dtype": config.dtype,
                        "target": target, "step": step, "window": config.capacity,
                        # max_rel only: a golden's few logit rows are no statistic for KL or top-1 (near-ties flip
                        # top-1), so it is held as quantize holds a step; the export held those on its prompt set
                        "budget": {"max_rel": quantize.tolerance(target, dtype_tolerance(config.dtype), grid)}
                                  | ({"decided": True} if half is not None and kind == "lm"
                                     and not scheme else {})}
                       | ({"eager_fp16_max_rel": drifts[step],
                           "output_budgets": {k: quantize.tolerance(target, dtype_tolerance(config.dtype, d), grid)
                                              for k, d in drifts[step].items()}} if drifts[step] is not None else {})
                       | ({"quantized": quantize.describe(scheme.name)
                                        | {"float_activations": _float_activations(exported, f"{step}.{target}{suffix}.onnx")}}
                          if scheme else {})
                       | ({"host_cache": {"inputs": cache_names(config, kind, "past_"),
                                          "shape": [config.batch, config.num_kv_heads, config.capacity, config.head_dim],
                                          "mask_value": registry.target(target).mask_value}}
                          if registry.target(target).cache == registry.HOST else {}))
    return entries


def _float_activations(exported: dict, file: str) -> list[str]:
    """The activations the export's QDQ graph `file` keeps float (mixed precision, export/quantize.py)."""
    return next((p.get("float_activations", []) for g in exported["graphs"] if g["file"] == file
                 for p in g["passes"] if p["pass"] == "quantize_qdq"), [])


def save_golden(path: Path, steps: list) -> None:
    arrays = {"steps": np.array(len(steps))}
    for i, (feeds, want, live, decided) in enumerate(steps):
        arrays |= {f"in.{i}.{k}": v for k, v in feeds.items()} | {f"out.{i}.{k}": v for k, v in want.items()}
        arrays[f"live.{i}"] = np.array(live)
        if decided is not None:
            arrays[f"decided.{i}"] = decided
    np.savez_compressed(path, **arrays)


def build(config: AttentionConfig, out: str | Path, kinds=KINDS, seed: int = 0, socs=qnn.SOCS,
          windows: tuple[int, ...] = (), weights: str | None = None, log=print) -> dict:
    """The bundle, every graph over each window of the ladder (`windows`; default: export/windows.py's). `weights`: a
    checkpoint for the whole model (a Hugging Face folder gives its dims), then the bundle holds that model alone."""
    out = Path(out)
    if weights is not None:
        kinds, config = ("lm",), model_config(config, "lm", weights)
    socs = tuple(socs) if qnn.available() else ()
    ladder = ladders.check(tuple(windows) or ladders.default(config), config)
    if short := [w for w in ladder if w < least_window(config)]:
        raise ladders.WindowError(f"windows {short}: a window's goldens hold two prefill chunks and {DECODE_STEPS} "
                                  f"decode steps after the first; expected W >= {least_window(config)}")
    progress = Progress(0, log)
    with staged_dir(out) as tmp:
        graphs = _graphs(config, kinds, seed, ladder, weights, bool(socs), tmp, progress)
        with progress.stage("compile"):
            binaries = {name: b for soc in socs for name, b in compile_binaries(tmp, graphs, soc, log).items()}
        with progress.stage("lint"):
            lints = {g["file"]: {"violations": [vars(v) for v in lint(tmp / g["file"], g["target"])],
                                 "notes": [vars(v) for v in lint(tmp / g["file"], g["target"], notes=True)]}
                     for g in graphs}
        if any(lints[g["file"]]["violations"] for g in graphs):
            raise RuntimeError(f"bundle check failed: lint {lints}")
        runtimes = {}
        for rt in available_runtimes(socs):
            with progress.stage(f"check on {rt}"):
                runtimes[rt] = refusals(tmp, graphs, rt)
            log(f"checked {len(graphs)} graphs on {rt} ({progress.elapsed():.0f} s)")
        with progress.stage("greedy text"):
            text = greedy_texts(tmp, graphs, build_model(config, "lm", seed, weights), available_runtimes(socs), log) \
                if "lm" in kinds and has_tokenizer(tmp / "lm-fp32") else None
        manifest = {"format": FORMAT, "config": config.to_dict(), "kinds": list(kinds), "windows": list(ladder),
                    "weights": weights or f"random(seed={seed})", **({"greedy": text} if text else {}),
                    "build_seconds": {k: round(v, 1) for k, v in progress.seconds.items()},
                    "contract": contract(),
                    "graphs": graphs, "runtimes": runtimes, "lint": "lint.json",
                    "qnn": {"version": qnn.version(), "socs": list(socs), "soc_names": {str(s): qnn.SOC_NAMES.get(s, "")
                                                                                      for s in socs},
                            "binaries": binaries,
                            "checked": {verify.PROVEN: sum(len(g.get("qnn", {})) for g in graphs), "run as shipped": 0},
                            "emulated": "compiled and run in host emulation of the HTP, not on a phone",
                            "precision": "float graphs in fp16 (enable_htp_fp16_precision=1), judged at 1e-2 or "
                                         f"{FP16_HEADROOM:g}x what fp16 costs the model in eager PyTorch "
                                         f"(fp16_drift; at most {FP16_CAP:g}), whichever is more; QDQ graphs "
                                         "(npu-w8a16) as quantized, the activations they keep float (a trained "
                                         "model's residual stream) in fp16, "
                                         "judged at their accuracy budget (or that, if more)"}
                    if socs else {"socs": [], "note": "onnxruntime-qnn is not installed: nothing compiled for the HTP"}}
        (tmp / "lint.json").write_text(json.dumps(lints, indent=2) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(readme(config, runtimes, manifest["qnn"], list(ladder), kinds, weights, text))
        sizes = footprint(tmp)
    log(f"wrote {out}: {len(graphs)} graphs, {sum(sizes.values()) / 1e6:.1f} MB ("
        + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()) + "); accepted by " +
        "; ".join(f"{rt}: {', '.join(t for t, r in rts.items() if not r['refuses']) or 'none'}"
                  for rt, rts in runtimes.items()))
    log(progress.summary())
    return manifest


def footprint(bundle: Path) -> dict[str, int]:
    """The bundle's bytes on disk: the compiled QNN files (qnnSOC/), the golden vectors, and the rest (the ONNX graphs,
    their weights, manifests and README)."""
    sizes = dict.fromkeys(("compiled", "goldens", "graphs"), 0)
    for f in (f for f in bundle.rglob("*") if f.is_file()):
        part = f.relative_to(bundle).parts[0]
        sizes["compiled" if part.startswith("qnn") and part[3:].isdigit() else
              "goldens" if f.name.endswith(".golden.npz") else "graphs"] += f.stat().st_size
    return sizes


def _graphs(config: AttentionConfig, kinds, seed: int, ladder: tuple, weights: str | None, htp: bool, tmp: Path,
            progress: Progress) -> list[dict]:
    """Every kind's graphs exported into the bundle, with their golden vectors and bundle entries; with `htp`, each
    entry also gets what fp16 costs the model over the whole window (fp16_drift)."""
    graphs = []
    for kind in kinds:
        for dtype, targets in variants()[kind]:
            c, folder = config.replace(dtype=dtype), f"{kind}-{dtype}"
            schemes = [registry.target(t).scheme for t in targets]
            with progress.stage("export"):
                exported = export_model(c, tmp / folder, kind=kind, seed=seed, windows=ladder, log=lambda *_: None,
                                        targets=tuple(t for t, q in zip(targets, schemes) if not q),
                                        quant=tuple(q.name for q in schemes if q), weights=weights)
            with progress.stage("goldens"):
                model = build_model(c, kind, seed, weights)
                half = model if dtype == "fp16" else None  # an fp16 graph is held to what fp16 costs the model
                for target in targets:
                    for w in sorted({g["window"] for g in exported["graphs"] if g["target"] == target}):
                        graphs += _goldens(model, c.replace(capacity=w), kind, target, folder, ladders.suffix(w, c),
                                           seed, tmp, exported, half)
                del model, half
            drifts = [d for g in graphs if g["kind"] == kind and g["dtype"] == dtype and "eager_fp16_max_rel" in g
                      for d in g["eager_fp16_max_rel"].values()]
            progress.log(f"exported {folder}: {', '.join(targets)} graphs with golden vectors" +
                         (f"; eager PyTorch fp16 against fp32 on them: max_rel up to {max(drifts):.2e}" if drifts
                          else "") + f" ({progress.elapsed():.0f} s)")
        if htp:  # what the HTP, computing in fp16, is held to (runtime/verify.py budget)
            with progress.stage("goldens"):
                drift = fp16_drift(config, kind, seed, weights)
            for g in (g for g in graphs if g["kind"] == kind):
                g["fp16_drift"] = drift
            progress.log(f"{kind}: eager PyTorch fp16 against fp32 over {config.capacity} rows: max_rel up to "
                         f"{max(drift.values()):.2e}, {next(iter(drift))} {next(iter(drift.values())):.2e}")
    return graphs


def binary_groups(graphs: list[dict]) -> dict[str, list[dict]]:
    """{binary name: the bundle graphs compiled into it}: per kind, every graph the HTP runs in fp16 (the fp32 and fp16
    npu graphs: one set of weights, stored once) in one binary, each quantized scheme's in another; every step and
    window of each."""
    groups = {}
    for g in (g for g in graphs if registry.target(g["target"]).cache == registry.HOST):
        scheme = registry.target(g["target"]).scheme
        groups.setdefault(f"{g['kind']}.{scheme.name if scheme else 'float'}.bin", []).append(g)
    return groups


def compile_binaries(bundle: Path, graphs: list[dict], soc: int, log=print) -> dict[str, dict]:
    """Each group's graphs (binary_groups) compiled for SoC `soc` into one weight-shared context binary in
    `qnn<soc>/`, beside a wrapper per graph (`qnn<soc>/<folder>.<file>`: what a device loads); each graph's manifest
    entry gains `qnn[soc]`: its wrapper, binary, sha256, the graph's name in the binary and how the check reaches it
    (verify.PROVEN). Returns the binaries' records."""
    folder, records = bundle / f"qnn{soc}", {}
    folder.mkdir()
    for name, members in binary_groups(graphs).items():
        wrappers = [folder / g["file"].replace("/", ".") for g in members]
        shared = qnn.compile_shared([bundle / g["file"] for g in members], soc, wrappers, name,
                                    [qnn.fp16_precision(g) for g in members])
        names = {g["name"] for g in binary_info(folder / name)["graphs"]}
        if len(names) != len(members):
            raise RuntimeError(f"{folder.name}/{name} holds {len(names)} graphs; expected the {len(members)} compiled "
                               "into it")
        for g, wrapper, record in zip(members, wrappers, shared["graphs"]):
            graph = check_wrapper(wrapper, bundle / g["file"])["name"]
            g.setdefault("qnn", {})[str(soc)] = {
                "wrapper": str(wrapper.relative_to(bundle)), "binary": f"{folder.name}/{name}",
                "sha256": shared["sha256"], "graph": graph, "check": verify.PROVEN,
                "soc_model": soc, "qnn": shared["qnn"]} | {k: record[k] for k in ("fp16_precision", "compile_seconds",
                                                                                  "placement")}
        records[f"{folder.name}/{name}"] = {"soc_model": soc, "bytes": shared["bytes"], "sha256": shared["sha256"],
                                            "graphs": len(names), "wrappers": [str(w.relative_to(bundle)) for w in wrappers]}
        log(f"compiled {len(members)} graphs for the QNN HTP of SoC {soc} into {folder.name}/{name} "
            f"({shared['bytes'] / 1e6:.1f} MB, {sum(r['compile_seconds'] for r in shared['graphs']):.0f} s)")
    return records


def greedy_texts(bundle: Path, graphs: list[dict], model, runtimes: list[str], log=print) -> dict:
    """The whole model's answer to CHAT through its chat template, GREEDY_TOKENS greedy tokens from eager fp32 and from
    every npu target of the bundle (over the capacity) on every runtime, with how many of them lead eager's."""
    tokenizer = load_tokenizer(bundle / "lm-fp32")
    prompt = chat_ids(tokenizer, CHAT, "the bundle")
    reference = reference_model(model)
    tokens, logits = (reference.generate_greedy if hasattr(reference, "generate_greedy") else partial(greedy, reference))(
        torch.tensor([prompt]), GREEDY_TOKENS)
    want, logits = tokens[0].tolist(), logits[0].detach().float().numpy()
    rows = [{"runtime": "eager PyTorch", "graph": "fp32", "tokens": want}]
    steps = {}
    widest = max(x["window"] for x in graphs if x["kind"] == "lm")
    for g in (g for g in graphs
              if g["kind"] == "lm" and registry.target(g["target"]).cache == registry.HOST and g["window"] == widest):
        steps.setdefault((g["dtype"], g["target"]), {})[g["step"]] = g
    for runtime in runtimes:
        for (dtype, target), pair in steps.items():
            rows.append({"runtime": runtime, "graph": f"{dtype} {target}",
                         "tokens": verify.greedy(bundle, pair, runtime, prompt, GREEDY_TOKENS)})
            log(f"greedy on {runtime}, {dtype} {target}: {tokenizer.decode(rows[-1]['tokens'])!r}")
    for row in rows:
        row["text"] = tokenizer.decode(row["tokens"], skip_special_tokens=False)
        row["leading_tokens_equal"] = i = next((i for i, (a, b) in enumerate(zip(row["tokens"], want)) if a != b),
                                               len(want))
        # where it left eager, how far apart eager's logits put the two tokens: a near-tie there is any scheme's
        # coin flip, a wide margin is a broken graph
        row["eager_margin"] = float(logits[i, want[i]] - logits[i, row["tokens"][i]]) if i < len(want) else None
    return {"chat": CHAT, "prompt_tokens": len(prompt), "new_tokens": GREEDY_TOKENS, "rows": rows}


def refusals(bundle: Path, graphs: list[dict], runtime: str) -> dict[str, dict]:
    """Per target, the ops `runtime` refuses (none: it runs every graph of the target within budget) and the error
    naming them, from the golden vectors. A graph that runs and misses its budget, that onnxruntime does not run, or
    that a runtime will not load without naming one of its ops, fails the build: the verifier would fail it."""
    record, failed = {}, []
    for g in graphs:
        r = verify_graph(bundle, g, runtime)
        ops = named(r.get("load_error", ""), op_types(bundle / g["file"]))
        if not r["ok"] and (runtime == "onnxruntime" or not ops):
            failed.append(f"{g['file']}: {r.get('why') or r.get('load_error')}")
        entry = record.setdefault(g["target"], {"refuses": []})
        entry["refuses"] = sorted(set(entry["refuses"]) | set(ops))
        entry |= {"error": r["load_error"]} if ops else {}
    if failed:
        raise RuntimeError(f"bundle check failed on {runtime}: {'; '.join(failed)}")
    return record


def op_types(path: Path) -> list[str]:
    return sorted({n.op_type for n in onnx.load(path, load_external_data=False).graph.node})


def contract() -> dict:
    """Each bundled float target's step interface (the registry's), and a host-cache target's whole-model one."""
    out = {}
    for name, t in ((n, t) for n, t in registry.TARGETS.items() if t.bundled and t.scheme is None):
        if t.cache == registry.GRAPH:
            out[name] = {
                "inputs": "hidden_states [B,T,E]; position_ids [B,T] int64; past_key, past_value [B,Hkv,C,D]",
                "outputs": "output [B,T,E]; present_key, present_value [B,Hkv,C,D]: past with rows p0..p0+T-1 "
                           "written; later rows unspecified",
                "opset": t.opset}
            continue
        mask = t.mask_value
        out[name] = {
            "inputs": "hidden_states [B,T,E]; position_ids [B,T] int32 (p0..p0+T-1); attention_mask [B,1,T,C+T] "
                      "additive; past_key, past_value [B,Hkv,C,D]",
            "outputs": "output [B,T,E]; key, value [B,Hkv,T,D]: the step's new rows (K after q/k norm and RoPE)",
            "mask": f"column j < C: 0 if j < p0 else {mask}; column C+t': 0 for query t if t' <= t else {mask}",
            "mask_value": mask,
            "cache_update": "host writes key/value into rows p0..p0+T-1 of its [B,Hkv,C,D] buffers after each step",
            "rope": "non-interleaved rotate_half; cos/sin gathered in the graph from constant tables by position_ids",
            "gqa": "query heads grouped as [B,Hkv,(H/Hkv)*T,D] against [B,Hkv,C+T,D]; K/V never repeated",
            "opset": t.opset}
        quantized = [q for q in registry.TARGETS.values() if q.scheme and q.parent == name and q.bundled]
        out[f"lm_{name}"] = {
            "inputs": "input_ids [B,T] int32; position_ids [B,T] int32; attention_mask [B,1,T,C+T] additive (one for "
                      "every layer); past_key.i, past_value.i [B,Hkv,C,D] for each layer i",
            "outputs": "logits [B,1,V] at the step's last position; key.i, value.i [B,Hkv,T,D]: each layer's new rows",
            "prompt": "feed a prompt so that its last token is the last row of a step: a partial chunk first (pad its "
                      "end; the next chunk overwrites those rows), or, shorter than T, all but its last token as one "
                      "padded chunk and the last token as a decode step",
            "weights": "weights.data beside the graphs (ONNX external data), shared by prefill and decode",
            "quantized": "; ".join(f"{q.name}: the same step in QDQ form (opset {q.opset}), attention_mask entries "
                                   f"{q.mask_value} instead of {mask}" for q in quantized)}
    return out


FOLDERS = {"attention": "| `attention-fp32/`, `attention-fp16/` | the attention block's `prefill.npu.onnx`, `decode.npu.onnx` (opset 17; "
                         "fp16 in `-fp16/`), and in `-fp32/` `prefill.onnx.onnx`, `decode.onnx.onnx` (opset 24) |",
           "block": "| `block-fp32/`, `block-fp16/` | the decoder block's graphs, as the attention block's |",
           "lm": "| `lm-fp32/`, `lm-fp16/` | the whole model's `prefill.npu.onnx`, `decode.npu.onnx`, their weights in "
                 "`weights.data`; in `lm-fp32/` also `prefill.npu-w8a16.onnx`, `decode.npu-w8a16.onnx`: the same steps "
                 "quantized (QDQ, opset 21) |"}


def _about(config: AttentionConfig, kinds, weights: str | None) -> str:
    dims = (f"E={config.hidden_size}, H={config.num_heads}, Hkv={config.num_kv_heads}, D={config.head_dim}, "
            f"{config.num_layers} layers, vocabulary {config.vocab_size}, cache C={config.capacity} rows, prefill chunk "
            f"T={config.chunk}, batch {config.batch}")
    if weights:
        return f"The whole causal language model of `{Path(weights).name}` ({dims}), its trained weights, as static ONNX graphs."
    return (f"MiniMind's {', '.join({'attention': 'attention block', 'block': 'decoder block', 'lm': 'whole causal language model'}[k] for k in kinds)} "
            f"({dims}), random weights (seed 0), as static ONNX graphs.")


def _answers(text: dict | None) -> str:
    """The greedy-text table: what each runtime's graphs answered to one chat message."""
    if not text:
        return ""
    rows = "\n".join(f"| {r['runtime']} | {r['graph']} | {r['leading_tokens_equal']} | "
                     f"{'' if r.get('eager_margin') is None else format(r['eager_margin'], '.3f')} | "
                     f"`{r['text'][:160]!r}` |" for r in text["rows"])
    return f"""
## What it answers

{text['chat']!r} through the model's chat template ({text['prompt_tokens']} tokens), then {text['new_tokens']}
greedy tokens, from eager PyTorch and from every npu graph over C rows on every runtime below (the host keeping the
cache as above); "equal" counts the leading tokens that are eager's; where a row leaves eager's tokens, "margin" is
how many logits eager's own choice there led the row's token by (a near-tie flips under any rounding):

| runtime | graph | equal | margin | text |
|---|---|---|---|---|
{rows}
"""


def readme(config: AttentionConfig, runtimes: dict, htp: dict, windows: list[int], kinds=KINDS,
           weights: str | None = None, text: dict | None = None) -> str:
    accepted = "\n".join(f"- {rt}: " + ", ".join(f"`{t}` " + (f"no (refuses {', '.join(r['refuses'])})" if r["refuses"]
                                                             else "yes") for t, r in rts.items())
                         for rt, rts in runtimes.items())
    deploy = "\n".join(f"| {soc} | {htp['soc_names'][str(soc)]} | `qnn{soc}/` | "
                       + ", ".join(f"`{Path(b).name}` {r['bytes'] / 1e6:.1f} MB ({r['graphs']} graphs)"
                                   for b, r in htp["binaries"].items() if r["soc_model"] == soc) + " |"
                       for soc in htp["socs"])
    compiled = (f"Every npu graph is also compiled for the Hexagon NPU (HTP) of each SoC below with {htp['version']}, "
                "every node on the HTP (CPU fallback disabled). Per SoC, folder `qnnSOC/` holds one QNN context binary "
                "per kind and scheme, every step and window of it inside and each weight stored once, and per graph "
                "a small `EPContext` wrapper (`<folder>.<file>`, embed mode 0) naming its graph in the binary. To "
                "deploy, copy the SoC's folder whole to a device with that chip and open each wrapper with "
                "onnxruntime's QNN execution provider (`backend_type` htp, the SoC's `soc_model`), every session "
                "with the session option `ep.share_ep_contexts` = 1, so each binary is loaded once, however many of "
                "its wrappers are open. Nothing is compiled on the device. The HTP runs the float graphs in fp16. They were compiled "
                "and checked in QNN's host emulation of the HTP, not on a phone: it loads a binary holding one graph, "
                "not one holding several, so each shipped graph in a shared binary was checked by running the same "
                "source compiled alone, proven equal to the shipped one by both binaries' metadata (`checked` in "
                f"manifest.json: {htp['checked'][verify.PROVEN]} proven, none run as shipped). A phone still has to confirm that the shared "
                "binaries load and match their goldens.") if htp["socs"] else htp["note"]
    QDQ_MASK = registry.QDQ_MASK_VALUE  # noqa: N806
    folders = "\n".join(FOLDERS[k] for k in kinds)
    return f"""# Attention hand-off bundle

{_about(config, kinds, weights)}

| folder | graphs |
|---|---|
{folders}

The quantized (QDQ) graphs hold QuantizeLinear/DequantizeLinear pairs around every op: weights int8 symmetric
per output channel, activations uint16 with ranges calibrated on activations recorded from real forward passes
(the calibration set and method are in each export's `manifest.json`). Their mask value is {QDQ_MASK}, not
{MASK_VALUE}, so the 16-bit scores keep their resolution. They are judged against eager fp32 at their accuracy
budget (`budget` in manifest.json), not at 1e-4; the measured accuracy is in `lm-fp32/manifest.json`.

Context windows: every float graph is there once per window W of the ladder {windows} (C's keep the names above,
the others add `.wW`: `decode.npu.w{windows[0]}.onnx`), all reading the same `weights.data`. Window W's graphs take
caches `[B,Hkv,W,D]` and an attention_mask `[B,1,T,W+T]` (C replaced by W below) and cost what W rows cost, not
C: run each step in the smallest W with p0+T <= W, and when W grows, move rows 0..p0-1 into the larger buffers.
The QDQ graphs are over C only.

Every graph has a `*.golden.npz` beside it: inputs and eager-PyTorch (fp32) outputs for steps of one random
sequence (token ids for the whole model, hidden states else) over the graph's window W, each step reading eager's
cache rows of that sequence before it. Prefill graphs: a chunk at position 0, one at T (over the first chunk's
rows: a graph that confuses the past K and V passes an empty cache, not this) and one ending at row W-1. Decode
graphs: {DECODE_STEPS} steps right after the first chunk, then one at row W-1, reading every row before it. So
each window's graphs are checked at that window's depth. The npu graphs' goldens leave the caches out but for the
rows before a step that no earlier step of the golden wrote: the verifier keeps them as your host would, writing
each step's reference rows; the others hold each present cache's rows written so far, the rows a check compares. Check them with `python -m runtime.verify .` (needs only numpy, onnxruntime
and, optionally, openvino and onnxruntime-qnn). Every output is held to its graph's budget (`budget` in
manifest.json: max_rel, the normwise relative error max |a - e| / max |e|: fp32 1e-4, fp16 1e-2, the QDQ
graphs' their scheme's; for logits also KL and top-1 where the budget has them); NaN or inf never passes. A
graph that runs and misses its budget FAILs on any runtime. Each output is held on its own: on QNN's HTP, which
computes in fp16, an output's budget is at least {FP16_HEADROOM:g}x its `fp16_drift`: what fp16 costs the model on
that output in eager PyTorch over the whole window, measured when the bundle was built (a deep trained model drifts
by itself; PyTorch's fp16 model keeps norms and softmax in fp32, the HTP does not), up to {FP16_CAP:g}; an fp16
graph's outputs are held to `output_budgets`: 1e-2 or {FP16_HEADROOM:g}x that output's `eager_fp16_max_rel` (what
fp16 costs the model there on that graph's goldens), whichever is more, on every runtime. "not accepted (as the manifest says)" is only for a
runtime that will not load a graph and names an op that `runtimes` in manifest.json records it refusing for the
graph's target (e.g. OpenVINO and QNN's HTP have no `TensorScatter`, which the `onnx` graphs use).

## The npu step

```
npu_step(hidden_states [B,T,E], position_ids [B,T] int32, attention_mask [B,1,T,C+T],
         past_key [B,Hkv,C,D], past_value [B,Hkv,C,D]) -> output [B,T,E], key [B,Hkv,T,D], value [B,Hkv,T,D]
```

- You own the cache: start with zeros; after a step at positions p0..p0+T-1, write `key`/`value` into rows
  p0..p0+T-1. A prompt longer than T goes in chunks of T (pad the last one; ignore padded outputs).
- `attention_mask` is additive and finite: column j < C is 0 if j < p0 else {MASK_VALUE}; column C+t' is 0 for
  query t if t' <= t else {MASK_VALUE}. Finite, so no row turns into NaN in fp16.
- RoPE is applied inside the graph (non-interleaved rotate_half) from constant cos/sin tables indexed by the
  int32 `position_ids`; V is not rotated.
- GQA groups the query heads ([B,Hkv,(H/Hkv)*T,D] against [B,Hkv,C+T,D]); K/V are never repeated.
- Static primitives only: no If/Loop/Scan, Shape/Range/ConstantOfShape/NonZero, scatter, Expand/Tile or
  computed Reshape; no infinities; no boolean inputs (see `lint.json`: no violations; its notes say what a
  toolchain must be told, e.g. that QNN's HTP compiles the fp32 RoPE and embedding tables only with fp16
  precision on).

The whole model's step is the same with token ids in and one cache pair per layer:

```
lm_npu_step(input_ids [B,T] int32, position_ids [B,T] int32, attention_mask [B,1,T,C+T],
            past_key.i, past_value.i [B,Hkv,C,D] for each layer i) -> logits [B,1,V], key.i, value.i [B,Hkv,T,D]
```

`logits` are the step's last position's: feed a prompt so that its last token is the last row of a step (a
partial chunk first, its end padded and overwritten by the next chunk; a prompt shorter than T as a padded
chunk of all but its last token, then a decode step for the last), then one decode step per new token.

## Compiled for Snapdragon NPUs (QNN HTP)

{compiled}

| soc_model | chip | deploy | context binaries |
|---|---|---|---|
{deploy}

## Verified on (measured when this bundle was built; a runtime that refuses a target names the ops)

{accepted}
{_answers(text)}"""


def main(argv=None) -> int:
    p = Parser(prog="python -m export.handoff", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="minimind", help="model config [minimind]")
    p.add_argument("--out", help="bundle folder [artifacts/PRESET/handoff; with --weights artifacts/NAME-handoff]")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="models to include [all]")
    p.add_argument("--weights", metavar="FOLDER", help="a trained whole model instead of the preset's random weights: "
                   "a checkpoint as python -m export --kind lm --weights takes it (a Hugging Face folder gives its "
                   "dims); the bundle then holds that model alone, and its README what each runtime's graphs answer to "
                   "a chat message [none]")
    p.add_argument("--capacity", type=int, help="cache rows C [the preset's]")
    p.add_argument("--chunk", type=int, help="prefill chunk T [the preset's]")
    p.add_argument("--socs", nargs="*", type=int, default=list(qnn.SOCS), metavar="SOC",
                   help=f"QNN soc_model numbers to compile the npu graphs for (none: skip) [{' '.join(map(str, qnn.SOCS))}]")
    p.add_argument("--windows", default="auto", metavar="SIZES",
                   help="the window ladder, as for python -m export (each window needs room for a prefill chunk and "
                        f"{DECODE_STEPS} decode steps) [auto]")
    return run(_build, p.parse_args(argv))


def _build(args) -> int:
    config = preset(args.preset, **{k: v for k, v in (("capacity", args.capacity), ("chunk", args.chunk)) if v})
    out = args.out or (f"artifacts/{Path(args.weights).name}-handoff" if args.weights else f"artifacts/{args.preset}/handoff")
    build(config, out, kinds=tuple(args.kinds), socs=args.socs, windows=ladders.parse(args.windows, config),
          weights=args.weights, log=partial(print, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
