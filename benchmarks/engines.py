"""The engines: eager PyTorch three ways, and onnxruntime on four graphs of the same model.

Every engine runs the same step (same weights, seed 0) with the same thread count;
onnxruntime engines run through the runtime's Generator, whose cache stays bound in place
between steps exactly as in a user's decode loop.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models import AttentionConfig, build_model
from models.contract import example_inputs
from runtime.artifacts import open_step
from runtime.drivers import Generator
from runtime.session import StepSession

from .workloads import Workload

ENGINES = ("torch-eager", "torch-sdpa", "torch-compile", "ort-raw", "ort-onnxscript", "ort-onnx", "ort-ort")


class Unavailable(RuntimeError):
    """The engine cannot run here; the message says why."""


class Engine:
    def __init__(self, name: str, config: AttentionConfig, folders: dict[str, Path], threads: int, profile: bool = False):
        if name not in ENGINES:
            raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}")
        self.name, self.config, self.folders, self.threads, self.profile = name, config, folders, threads, profile
        self._models, self._generators = {}, {}
        torch.set_num_threads(threads)

    def runner(self, w: Workload):
        """A no-argument callable running the workload's step once."""
        if self.name.startswith("torch"):
            return self._torch_runner(w)
        target = self.name.removeprefix("ort-")
        gen = self._generator(w.kind, target)
        x = example_inputs(self.config, w.seq_len(self.config), w.p0)[0].numpy()
        return lambda: gen.run_step(w.step, x, w.p0)

    def _torch_runner(self, w: Workload):
        model = self._torch_model(w.kind)
        args = example_inputs(self.config, w.seq_len(self.config), w.p0)

        def run():
            with torch.inference_mode():
                return model(*args)
        return run

    def _torch_model(self, kind: str):
        if kind not in self._models:
            model = build_model(self.config.replace(sdpa=self.name == "torch-sdpa"), kind, seed=0)
            if self.name == "torch-compile":
                model = torch.compile(model, dynamic=False)
            self._models[kind] = model
        return self._models[kind]

    def _generator(self, kind: str, target: str) -> Generator:
        """The export's graphs open as the manifest describes them (in-place cache or not); the
        optimize_for_ort graphs, which are not in it, keep ScatterElements and so a copied cache."""
        if (kind, target) not in self._generators:
            options = {"provider": "cpu", "threads": self.threads, "profile": self.profile}
            if target == "onnxscript":
                sessions = [StepSession(self.folders[kind] / f"{step}.onnxscript.onnx", **options)
                            for step in ("prefill", "decode")]
            else:
                sessions = [open_step(self.folders[kind], step, target, **options) for step in ("prefill", "decode")]
            self._generators[kind, target] = Generator(*sessions)
        return self._generators[kind, target]


def warm_check(engine: Engine, w: Workload) -> None:
    """Run once, turning a failure (e.g. torch.compile without a working compiler) into Unavailable."""
    try:
        out = engine.runner(w)()
    except Exception as e:
        raise Unavailable(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}") from None
    first = out[0] if isinstance(out, tuple) else out
    if not np.isfinite(np.asarray(first.float() if isinstance(first, torch.Tensor) else first)).all():
        raise Unavailable("produced non-finite output")
