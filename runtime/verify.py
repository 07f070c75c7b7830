"""python -m runtime.verify BUNDLE_DIR: re-run a hand-off bundle's golden vectors, needing only the bundle.

Every graph listed in the bundle's manifest.json is run on its golden inputs in
onnxruntime (CPU); where the `openvino` package is installed, compiled and run with
OpenVINO on its CPU device; and where `onnxruntime-qnn` is installed, on Qualcomm's QNN HTP
in host emulation for each SoC the bundle was compiled for (`qnn-htp-57`, ...): through the
bundle's compiled EPContext model for that SoC where it has one, else compiled from the graph,
either way with no CPU fallback. The HTP runs float graphs in fp16, so they are judged at the
fp16 tolerance there; quantized (QDQ) graphs run as quantized, everywhere judged at the accuracy
budget the bundle records for them. Each output is compared with the eager-PyTorch output stored beside
the inputs (present_* only on the rows written so far, as the step contract says). Prints one
line per graph and runtime; exits 1 if a graph fails in onnxruntime, or a graph the manifest
says another runtime accepts fails there.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from . import qnn
from .cli import Parser, run
from .metrics import close, error, worst

import numpy as np
import onnxruntime as ort


class BundleError(ValueError):
    """A folder that is not a readable hand-off bundle."""


def golden_steps(path: Path) -> list[tuple[dict, dict, int]]:
    """[(inputs, expected outputs, rows written so far)] for each step stored in a golden .npz."""
    data = np.load(path)
    steps = []
    for i in range(int(data["steps"])):
        inputs = {k.split(".", 2)[2]: data[k] for k in data.files if k.startswith(f"in.{i}.")}
        outputs = {k.split(".", 2)[2]: data[k] for k in data.files if k.startswith(f"out.{i}.")}
        steps.append((inputs, outputs, int(data[f"live.{i}"])))
    return steps


def compare(got: dict, want: dict, live: int) -> dict:
    """Worst error over the outputs (present_* on the rows written so far); with the LM's greedy tokens stored,
    also whether the graph's top-1 token is eager's."""
    rows = lambda name, x: x[:, :, :live] if name.startswith("present") else x  # noqa: E731
    err = worst([error(rows(name, got[name]), rows(name, expected)) for name, expected in want.items()
                 if name != "greedy"])
    if "greedy" in want:
        err["top1"] = float((got["logits"][:, -1].argmax(-1) == want["greedy"][:, -1]).mean())
    return err


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
        return {out.get_any_name(): result[out] for out in compiled.outputs}
    return run


def _qnn(path: Path, soc: int, fp16: bool):
    session = qnn.session(path, soc, fp16=fp16)
    return lambda feeds: dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


RUNTIMES = {"onnxruntime": _onnxruntime, "openvino-cpu": _openvino}
QNN = "qnn-htp-"


def _runner(bundle: Path, graph: dict, runtime: str):
    if runtime.startswith(QNN):
        soc = runtime.removeprefix(QNN)
        compiled = graph.get("qnn", {}).get(soc)
        return _qnn(bundle / (compiled["file"] if compiled else graph["file"]), int(soc), "quantized" not in graph)
    return RUNTIMES[runtime](bundle / graph["file"])


def tolerance(graph: dict, runtime: str) -> float:
    """The graph's, or the fp16 one on the HTP, which runs float graphs in fp16."""
    return max(graph["tolerance"], qnn.TOLERANCE) if runtime.startswith(QNN) else graph["tolerance"]


def verify_graph(bundle: Path, graph: dict, runtime: str) -> dict:
    try:
        run = _runner(bundle, graph, runtime)
        steps = golden_steps(bundle / graph["golden"])
        host = HostCache(graph["host_cache"], steps[0][0]["attention_mask"].dtype) if "host_cache" in graph else None
        errors = []
        for inputs, want, live in steps:
            errors.append(compare(run(host.feeds(inputs) if host else inputs), want, live))
            if host:
                host.write(inputs, want)
    except Exception as e:
        return {"ok": False, "error": _reason(e)}
    err = worst(errors)
    top1 = [e["top1"] for e in errors if "top1" in e]
    return {"ok": close(err, tolerance(graph, runtime)), **err, "steps": len(errors),
            **({"top1_agreement": float(np.mean(top1))} if top1 else {})}


def _reason(e: Exception) -> str:
    """One line: the most telling line of a runtime's (often multi-line) message."""
    lines = [line.strip(" -") for line in str(e).splitlines() if line.strip()]
    telling = [line for line in lines if "conversion rule" in line or "not supported" in line.lower()]
    return f"{type(e).__name__}: {(telling or lines or [''])[-1][:200]}"


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
    try:
        manifest = json.loads((bundle / "manifest.json").read_text())
        graphs = manifest["graphs"]
    except (OSError, ValueError, KeyError) as e:
        raise BundleError(f"{bundle}: no readable manifest.json with graphs ({e}); expected a bundle from make handoff") from None
    ok = True
    for graph in graphs:
        for runtime in available_runtimes(manifest.get("qnn", {}).get("socs", ())):
            expected = manifest.get("runtimes", {}).get(runtime, {}).get(graph["target"], True)
            r = verify_graph(bundle, graph, runtime)
            status = "pass" if r["ok"] else ("FAIL" if expected else "not accepted (as the manifest says)")
            detail = f"max abs {r['max_abs']:.2e}, rel {r['max_rel']:.2e} over {r['steps']} step(s)" if "steps" in r \
                else r["error"]
            if "top1_agreement" in r:
                detail += f", greedy top-1 {r['top1_agreement']:.0%}"
            if runtime.startswith(QNN) and "steps" in r:
                soc = runtime.removeprefix(QNN)
                detail += (f", compiled {graph['qnn'][soc]['file']}" if soc in graph.get("qnn", {}) else "") \
                    + (", quantized on the HTP" if "quantized" in graph else ", fp16 on the HTP")
            if "quantized" in graph and "steps" in r:
                detail += f" (budget {graph['tolerance']})"
            log(f"{status:5s} {runtime:12s} {graph['file']}: {detail}")
            ok &= r["ok"] or not expected
    return ok


def main(argv=None) -> int:
    p = Parser(prog="python -m runtime.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", help="a hand-off folder (artifacts/NAME/handoff)")
    return run(lambda args: 0 if verify(args.bundle) else 1, p.parse_args(argv), status=2)


if __name__ == "__main__":
    sys.exit(main())
