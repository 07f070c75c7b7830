"""python -m runtime.verify BUNDLE_DIR: re-run a hand-off bundle's golden vectors, needing only the bundle.

Every graph listed in the bundle's manifest.json is run on its golden inputs in
onnxruntime (CPU); where the `openvino` package is installed, compiled and run with
OpenVINO on its CPU device; and where `onnxruntime-qnn` is installed, on Qualcomm's QNN HTP
in host emulation for each SoC the bundle was compiled for (`qnn-htp-57`, ...), with no CPU
fallback. The bundle ships, per SoC, wrappers over weight-shared context binaries holding several
graphs each, which QNN's host emulation does not load: so the graph compiled alone from its source
is run, once the shipped graph is shown to be its equal (the binary's sha256 as the manifest has
it, the wrapper naming the graph the manifest records, and that graph's inputs, outputs, QNN build
and SoC in the binary's own metadata those of the graph compiled alone). A graph the bundle did
not compile is compiled from the graph. The HTP runs float graphs in fp16, so they are judged at the
fp16 tolerance there, or at metrics.FP16_HEADROOM times the model's own fp16 drift on that output in eager PyTorch
(the bundle's fp16_drift, per output; at most metrics.FP16_CAP) where that is more (metrics.fp16_tolerance); quantized (QDQ) graphs run as quantized, everywhere judged at the accuracy
budget the bundle records for them. Each output is compared with the eager-PyTorch output stored
beside the inputs (present_* only on the rows written so far, as the step contract says) by
runtime/metrics.py's rule, at the graph's budget (for logits also its KL and top-1 bounds where it
has them). Prints one line per graph and runtime: pass; FAIL and the measure that missed; or "not
accepted (as the manifest says)" where the runtime would not load the graph and its error names an
op the manifest records that runtime refusing for the graph's target. A graph that runs and misses
its budget fails, on every runtime; exits 1 on any FAIL.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from . import qnn
from .cli import Parser, run
from .qnn_binary import BinaryError, binary_info, check_wrapper, differences
from .metrics import Budget, error, fp16_tolerance, logit_error, per_output, swapped, worst

import numpy as np
import onnxruntime as ort


# manifest.json: 2 records, per runtime and target, the ops the runtime refuses; 3 ships the npu graphs compiled for
# each SoC as wrappers over weight-shared context binaries (qnnSOC/), with each binary's sha256
FORMAT = 3


class BundleError(ValueError):
    """A folder that is not a readable hand-off bundle."""


def golden_steps(path: Path) -> list[tuple[dict, dict, int, np.ndarray | None]]:
    """[(inputs, expected outputs, rows written so far, the logit rows eager decides or None)] for each step stored in
    a golden .npz (`decided` where the bundle measured eager fp16 on it: metrics.decided_rows)."""
    data = np.load(path)
    steps = []
    for i in range(int(data["steps"])):
        inputs = {k.split(".", 2)[2]: data[k] for k in data.files if k.startswith(f"in.{i}.")}
        outputs = {k.split(".", 2)[2]: data[k] for k in data.files if k.startswith(f"out.{i}.")}
        decided = data[f"decided.{i}"] if f"decided.{i}" in data.files else None
        steps.append((inputs, outputs, int(data[f"live.{i}"]), decided))
    return steps


def compare(got: dict, want: dict, live: int, decided: np.ndarray | None = None) -> dict[str, dict]:
    """Each output's error (present_* on the rows written so far); logits also count the rows eager decides whose
    argmax they swap."""
    rows = lambda name, x: x[:, :, :live] if name.startswith("present") else x  # noqa: E731
    errs = {name: error(rows(name, got[name]), rows(name, expected)) for name, expected in want.items()}
    if decided is not None and "logits" in want:
        errs["logits"]["swapped"] = swapped(got["logits"], want["logits"], decided)
    return errs


class HostCache:
    """The caches of a golden that leaves them out (the whole model's): the rows it stores for before its first
    step (or zeros), then after each step the reference's new rows, written at the step's positions, as a host does."""

    def __init__(self, spec: dict, dtype):
        self.caches = {name: np.zeros(spec["shape"], dtype) for name in spec["inputs"]}

    def feeds(self, inputs: dict) -> dict:
        for name, cache in self.caches.items():
            if name in inputs:
                cache[:, :, :inputs[name].shape[2]] = inputs[name]
        return {k: v for k, v in inputs.items() if k not in self.caches} | self.caches

    def write(self, inputs: dict, want: dict) -> None:
        p0, t = int(inputs["position_ids"][0, 0]), inputs["position_ids"].shape[1]
        for name, cache in self.caches.items():
            cache[:, :, p0:p0 + t] = want[name.removeprefix("past_")]


def _onnxruntime(path: Path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda feeds: dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _openvino(path: Path):
    import openvino as ov
    core = ov.Core()
    # OpenVINO's CPU plugin computes in bf16 where the processor has it, unless asked for f32.
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()

    def run(feeds):
        result = request.infer(feeds)
        # by every name an output has: get_any_name() may pick an inner tensor's name in place of the graph output's
        return {name: result[out] for out in compiled.outputs for name in out.get_names()}
    return run


def _qnn(path: Path, soc: int, fp16: bool):
    session = qnn.session(path, soc, fp16=fp16)
    return lambda feeds: dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


RUNTIMES = {"onnxruntime": _onnxruntime, "openvino-cpu": _openvino}
QNN = "qnn-htp-"


def _runner(bundle: Path, graph: dict, runtime: str):
    if runtime.startswith(QNN):
        soc, fp16 = int(runtime.removeprefix(QNN)), qnn.fp16_precision(graph)
        shipped = graph.get("qnn", {}).get(str(soc))
        if shipped is None:  # a graph the bundle did not compile (a planted copy): compiled from its source
            return _qnn(bundle / graph["file"], soc, fp16)
        found = _shipped(bundle, graph, shipped, soc)
        with tempfile.TemporaryDirectory() as folder:  # the session keeps what it loaded; the files can go
            return _qnn(_alone(bundle, graph, found, shipped["fp16_precision"], Path(folder)), soc, fp16)
    return RUNTIMES[runtime](bundle / graph["file"])


# How the check reaches a shipped QNN wrapper. Its binary holds every step and window of its kind and scheme, which QNN's
# host emulation does not load (runtime/qnn_binary.py), so the graph compiled alone from the same source is run there
# and the shipped graph is proven equal to it by both binaries' metadata.
PROVEN = "proven equal by binary metadata to a single-graph context that was run"


def _shipped(bundle: Path, graph: dict, shipped: dict, soc: int) -> dict:
    """The shipped wrapper's graph (check_wrapper), once its binary is the one the manifest hashed, compiled for SoC
    `soc`, and the wrapper names the graph the manifest records; raises BinaryError naming what differs."""
    binary = bundle / shipped["binary"]
    if (digest := _sha256(binary, *_stat(binary))) != shipped["sha256"]:
        raise BinaryError(f"{shipped['binary']}: sha256 {digest[:16]}...; expected {shipped['sha256'][:16]}... "
                          "(manifest.json): the binary changed after the bundle was built")
    found = check_wrapper(bundle / shipped["wrapper"], bundle / graph["file"])
    if (found["binary"], found["name"]) != (binary.name, shipped["graph"]):
        raise BinaryError(f"{shipped['wrapper']}: runs graph {found['name']} of {found['binary']}; expected "
                          f"{shipped['graph']} of {binary.name} (manifest.json)")
    if found["soc_model"] != soc:
        raise BinaryError(f"{shipped['binary']}: compiled for SoC {found['soc_model']}; expected {soc}")
    return found


def _alone(bundle: Path, graph: dict, found: dict, fp16: bool, folder: Path) -> Path:
    """The wrapper of `graph` compiled alone (into `folder`) for the shipped graph's SoC (`found`) with its options,
    once the shipped graph is shown to be its equal: its inputs, outputs, QNN build and SoC in its binary's metadata
    those of the graph compiled alone. Raises BinaryError naming what differs."""
    wrapper = folder / "alone.onnx"
    qnn.compile_shared([bundle / graph["file"]], found["soc_model"], [wrapper], "alone.bin", [fp16])
    alone = binary_info(folder / "alone.bin")
    if differs := differences(found, alone["graphs"][0] | {"build": alone["build"], "soc_model": alone["soc_model"]}):
        raise BinaryError(f"{graph['file']}: graph {found['name']} of {found['binary']} is not the graph its source "
                          f"compiles to alone: {'; '.join(differs)}")
    return wrapper


def _stat(path: Path) -> tuple[int, int]:
    try:
        return path.stat().st_size, path.stat().st_mtime_ns
    except OSError:
        raise BinaryError(f"{path}: no such file; expected the context binary manifest.json names") from None


@functools.cache
def _sha256(path: Path, size: int, mtime: int) -> str:  # a part's binary is a gigabyte: hashed once while unchanged
    return qnn.sha256(path)


def budget(graph: dict, runtime: str, output: str) -> Budget:
    """What the graph's `output` is held to: the graph's budget, an fp16 graph's output its own (`output_budgets`);
    on the HTP, which runs float graphs in fp16, a max_rel at least the fp16 tolerance and what fp16 costs the model
    on that output in eager PyTorch allows (fp16_tolerance of the bundle's fp16_drift for it)."""
    b = Budget(**graph["budget"])
    b = replace(b, max_rel=graph.get("output_budgets", {}).get(output, b.max_rel))
    if not runtime.startswith(QNN):
        return b
    drift = graph.get("fp16_drift", {})  # by the step contract's names: an npu graph's new rows `key.i` are present_*'s
    return replace(b, max_rel=max(b.max_rel, fp16_tolerance(drift.get(output, drift.get("present_" + output)))))


def verify_graph(bundle: Path, graph: dict, runtime: str) -> dict:
    """{'ok', 'why': None or the measure that missed, the errors, 'steps'}; {'ok': False, 'load_error'} where the
    runtime would not load (compile) the graph; {'ok': False, 'why'} where it loaded but failed to run a step."""
    try:
        run = _runner(bundle, graph, runtime)
    except Exception as e:
        return {"ok": False, "load_error": _reason(e)}
    try:
        err = _run_goldens(bundle, graph, run)
    except Exception as e:
        return {"ok": False, "why": f"failed to run: {_reason(e)}"}
    missed = per_output(err["per_output"], {name: budget(graph, runtime, name) for name in err["per_output"]})
    why = f"{missed[1]} ({missed[0]})" if missed else None
    return {"ok": why is None, "why": why, **err}


def _run_goldens(bundle: Path, graph: dict, run) -> dict:
    """The worst error over the graph's golden steps, and each output's (`per_output`); for logits also KL and top-1
    over all the steps' rows."""
    steps = golden_steps(bundle / graph["golden"])
    host = HostCache(graph["host_cache"], steps[0][0]["attention_mask"].dtype) if "host_cache" in graph else None
    errors, logits = [], []
    for inputs, want, live, decided in steps:
        got = run(host.feeds(inputs) if host else inputs)
        errors.append(compare(got, want, live, decided))
        if "logits" in want:
            logits.append((got["logits"], want["logits"]))
        if host:
            host.write(inputs, want)
    outputs = {name: worst([e[name] for e in errors]) for name in errors[0]}
    if logits:
        dist = logit_error(*(np.concatenate(x) for x in zip(*logits)))
        outputs["logits"] |= {k: dist[k] for k in ("kl_mean", "kl_max", "top1")}
    return worst(list(outputs.values())) | {"steps": len(steps), "per_output": outputs}


def greedy(bundle: Path, graphs: dict[str, dict], runtime: str, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` from a whole model's npu step graphs (`graphs`: the bundle's entries by
    step, over one window) run on `runtime`, the caches and masks kept by the runtime's own host-cache driver."""
    from .drivers import HostCacheGenerator
    from .generate import generate
    from .session import StepSession
    sessions = {step: StepSession(bundle / g["file"], provider="cpu") for step, g in graphs.items()}
    driver = HostCacheGenerator(sessions["prefill"], sessions["decode"], graphs["decode"]["host_cache"]["mask_value"])
    if runtime != "onnxruntime":  # the driver's feeds, run by the other runtime
        runners = {id(sessions[step]): _runner(bundle, g, runtime) for step, g in graphs.items()}
        driver.infer = lambda session, feeds: runners[id(session)](feeds)
    return generate(driver, prompt, new_tokens)["generated_ids"]


def named(message: str, ops) -> list[str]:
    """The ops among `ops` that `message` names (as words: `TensorScatter-24` names TensorScatter)."""
    return [op for op in ops if re.search(rf"\b{re.escape(op)}\b", message)]


def _reason(e: Exception) -> str:
    """One line: the most telling line of a runtime's (often multi-line) message."""
    lines = [line.strip(" -") for line in str(e).splitlines() if line.strip()]
    telling = [line for line in lines if "conversion rule" in line or "not supported" in line.lower()]
    return f"{type(e).__name__}: {(telling or lines or [''])[-1][:300]}"


def available_runtimes(socs=()) -> list[str]:
    """onnxruntime, OpenVINO's CPU device if installed, and the QNN HTP of each SoC in `socs` if installed."""
    found = ["onnxruntime"]
    try:
        import openvino  # noqa: F401
        found.append("openvino-cpu")
    except ImportError:
        pass
    return found + ([f"{QNN}{soc}" for soc in socs] if qnn.available() else [])


def verify(bundle: str | Path, log=print) -> bool:
    bundle = Path(bundle)
    manifest = _manifest(bundle)
    ok = True
    for graph in manifest["graphs"]:
        for runtime in available_runtimes(manifest["qnn"]["socs"]):
            r = verify_graph(bundle, graph, runtime)
            refuses = manifest["runtimes"].get(runtime, {}).get(graph["target"], {}).get("refuses", [])
            excused = named(r.get("load_error", ""), refuses)
            status = "pass" if r["ok"] else "not accepted (as the manifest says)" if excused else "FAIL"
            log(f"{status:5s} {runtime:12s} {graph['file']}: {_detail(r, graph, runtime, excused)}")
            ok &= r["ok"] or bool(excused)
    return ok


def _manifest(bundle: Path) -> dict:
    try:
        manifest = json.loads((bundle / "manifest.json").read_text())
        if "graphs" not in manifest:
            raise ValueError("it lists no graphs")
    except (OSError, ValueError, TypeError) as e:
        raise BundleError(f"{bundle}: no readable manifest.json with graphs ({e}); expected a bundle from make handoff") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{bundle}: manifest format {manifest.get('format')}; expected {FORMAT} (rebuild it with make "
                          "handoff: earlier bundles embed a copy of the weights in every compiled graph)")
    return manifest


def _detail(r: dict, graph: dict, runtime: str, excused: list[str]) -> str:
    """What the status line says after the graph: the load error (naming the refused op where excused), the measure
    that missed, the errors measured."""
    if "load_error" in r:
        return r["load_error"] if excused else f"did not load: {r['load_error']}"
    if "steps" not in r:
        return r["why"]
    detail = f"max abs {r['max_abs']:.2e}, rel {r['max_rel']:.2e} over {r['steps']} step(s)"
    if "top1" in r:
        detail += f", top-1 {r['top1']:.0%}, KL {r['kl_mean']:.1e}"
    if runtime.startswith(QNN):
        soc = runtime.removeprefix(QNN)
        kept = graph.get("quantized", {}).get("float_activations")
        precision = "fp16" if "quantized" not in graph else "quantized" + (f" ({len(kept)} activations fp16)" if kept else "")
        shipped = graph.get("qnn", {}).get(soc)
        detail += (f", shipped {shipped['wrapper']} ({shipped['check']})" if shipped else ", compiled from the graph") \
            + f", {precision} on the HTP"
    if "quantized" in graph:
        detail += f" (budget {', '.join(f'{k} {v:g}' for k, v in graph['budget'].items())})"
    return f"{r['why']}; {detail}" if r["why"] else detail


def main(argv=None) -> int:
    p = Parser(prog="python -m runtime.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", help="a hand-off folder (artifacts/NAME/handoff)")
    return run(lambda args: 0 if verify(args.bundle) else 1, p.parse_args(argv), status=2)


if __name__ == "__main__":
    sys.exit(main())
