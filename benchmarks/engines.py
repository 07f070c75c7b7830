"""The engines: eager PyTorch, onnxruntime on each target's graphs, onnxruntime-genai and llama.cpp.

The engines: eager PyTorch three ways, onnxruntime on four graphs of the same model, and for the whole
model our int4/int8 ort graphs, the ort graphs exported from transformers' Qwen3ForCausalLM holding the same
weights (ort-ort-hf), onnxruntime-genai (its model builder's fp32 and int4 builds of the same weights), and for a
trained model llama.cpp (llama-cpp-python on GGUFs of the same folder).

Every engine runs the same step (same weights, seed 0, or the trained folder's) with the same thread count.
onnxruntime engines run through the runtime's Generator, whose caches stay bound in place
between steps exactly as in a user's decode loop. For the whole model the eager engines run
MiniMind's own concatenating cache (`forward_cat`), or for a trained model transformers' own model over its
DynamicCache; genai and llama.cpp their own generators.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models import AttentionConfig, build_model
import registry
from models.contract import STEPS, example_inputs
from runtime.artifacts import graph_entry, load_manifest, open_generator, windows
from runtime.drivers import Driver, Generator
from runtime.session import StepSession

from .peers import genai_model
from .workloads import GENAI, HF, LLAMACPP, ORT, QUANT, SINGLE, TORCH, TRAINED, Workload

ENGINES = TORCH + ORT + SINGLE + QUANT + HF + GENAI + LLAMACPP


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
        """A no-argument callable running the workload once."""
        if self.name not in w.engines:
            raise Unavailable(f"{self.name} does not run {w.kind} workloads")
        if self.name.startswith("torch"):
            return self._transformers_runner(w) if w.kind in TRAINED else self._torch_runner(w)
        if self.name.startswith("genai"):
            return self._genai_runner(w)
        if self.name in LLAMACPP:
            return self._llamacpp_runner(w)
        gen = self._generator(w.kind)
        x = self._inputs(w)[0].numpy()
        if w.lm and w.step == "prefill":  # time to first token: the whole prompt, fed in chunks
            return lambda: (gen.reset(), gen.feed(x))[1]
        return lambda: gen.run_step(w.step, x, w.p0)

    def _inputs(self, w: Workload) -> tuple:
        return example_inputs(self.config, w.seq_len(self.config), w.start(), kind="lm" if w.lm else "attention")

    def _context(self, w: Workload) -> np.ndarray:
        """Token ids [p0] a peer engine reads before its timed decode step (its cache then holds p0 rows)."""
        return np.random.default_rng(0).integers(0, self.config.vocab_size, w.p0)

    def _transformers_runner(self, w: Workload):
        """A trained model in eager PyTorch as transformers runs it: its own forward over a DynamicCache, the logits of
        the last position only; a decode step is timed at context p0 and cropped back to p0 after each run."""
        from transformers import DynamicCache
        if w.kind not in self._models:
            self._models[w.kind] = build_model(self.config, "lm", weights=str(self.folders["weights"])).model
        model, ids = self._models[w.kind], self._inputs(w)[0]

        def forward(tokens, cache):
            with torch.inference_mode():
                return model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        if w.step == "prefill":
            return lambda: forward(ids, DynamicCache(config=model.config))
        cache = DynamicCache(config=model.config)
        forward(torch.from_numpy(self._context(w))[None], cache)

        def decode():
            out = forward(ids, cache)
            cache.crop(-1)  # transformers 5: a negative count removes that many tokens (the one decoded)
            return out
        return decode

    def _llamacpp_runner(self, w: Workload):
        """llama.cpp on the engine's GGUF: a prompt read into an empty cache, or one token at context p0."""
        from .llamacpp import LlamaCppDriver
        if self.name not in self._models:
            self._models[self.name] = LlamaCppDriver(self.folders[self.name], self.threads, self.config.capacity)
        driver = self._models[self.name]
        if w.step == "prefill":
            return driver.prefill_runner(self._inputs(w)[0].numpy())
        return driver.decode_runner(self._context(w)[None])

    def _torch_runner(self, w: Workload):
        model = self._torch_model(w.kind)
        args = self._inputs(w)
        if w.kind == "lm":  # MiniMind's concatenating cache, holding p0 rows before a decode step
            ids, pos = args[:2]
            past = None if w.step == "prefill" else [
                tuple(torch.randn(self.config.batch, w.p0, self.config.num_kv_heads, self.config.head_dim,
                                  dtype=self.config.torch_dtype) for _ in range(2)) for _ in range(self.config.num_layers)]
            args = (ids, pos, past)

        def run():
            with torch.inference_mode():
                return model(*args)
        return run

    def _torch_model(self, kind: str):
        if kind not in self._models:
            model = build_model(self.config.replace(sdpa=self.name == "torch-sdpa"), kind, seed=0)
            step = model.forward_cat if kind == "lm" else model
            self._models[kind] = torch.compile(step, dynamic=False) if self.name == "torch-compile" else step
        return self._models[kind]

    def window(self, w: Workload) -> int | None:
        """The cache rows the engine's last run of `w` attended over (its window), for onnxruntime engines."""
        gen = self._generators.get(w.kind)
        return gen.window if gen is not None else None

    def _generator(self, kind: str) -> Driver:
        """The export's graphs open as a user opens them (artifacts.open_generator: the window ladder, or its
        largest window alone for the -single engines); the optimize_for_ort graphs, which are not in the
        manifest, open over the raw graphs' ladder, so ort-onnxscript and ort-raw attend over the same rows."""
        if kind not in self._generators:
            target = self.name.removeprefix("ort-").removesuffix("-single")
            options = {"provider": "cpu", "threads": self.threads, "profile": self.profile}
            if target == "onnxscript":
                self._generators[kind] = onnxscript_generator(self.folders[kind], **options)
            elif self.name in HF:
                self._generators[kind] = open_generator(self.folders[self.name], registry.RUN_BY_DEFAULT, **options)
            else:
                self._generators[kind] = open_generator(self.folders[kind], target,
                                                        ladder=not self.name.endswith("-single"), **options)
        return self._generators[kind]

    def _genai_runner(self, w: Workload):
        import onnxruntime_genai as og
        if (w.kind, self.name) not in self._models:
            self._models[w.kind, self.name] = genai_model(self.folders[self.name], self.threads)
        model = self._models[w.kind, self.name]
        ids = self._inputs(w)[0].numpy()[0].astype(np.int32)
        prompt = ids if w.step == "prefill" else self._context(w).astype(np.int32)

        def generator():
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(prompt) + 2, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens(prompt)
            return gen
        if w.step == "prefill":  # time to first token: a generator reading the prompt
            return lambda: generator().get_logits()
        gen = generator()  # then one token at context p0, again and again

        def decode():
            gen.generate_next_token()
            gen.rewind_to(w.p0)
        return decode


def onnxscript_file(raw_file: str) -> str:
    """optimize_for_ort's rewrite of a raw graph, beside it: prefill.raw.w256.onnx -> prefill.onnxscript.w256.onnx."""
    return raw_file.replace(".raw.", ".onnxscript.", 1)


def onnxscript_generator(folder: Path, **options) -> Generator:
    """optimize_for_ort's graphs over the raw target's window ladder. They keep ScatterElements, so the cache is
    copied each step (no in-place binding), as the raw graphs' is."""
    manifest, root = load_manifest(folder), registry.root()
    smallest, *larger = [(w, tuple(StepSession(folder / onnxscript_file(graph_entry(manifest, step, root, w)["file"]),
                                               **options) for step in STEPS)) for w in windows(manifest, root)]
    return Generator(*smallest[1], dict(larger))


def warm_check(engine: Engine, w: Workload) -> None:
    """Run once, turning a failure (e.g. torch.compile without a working compiler) into Unavailable."""
    try:
        out = engine.runner(w)()
    except Unavailable:
        raise
    except Exception as e:
        raise Unavailable(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}") from None
    first = out[0] if isinstance(out, tuple) else out  # the output or logits; None where the engine keeps them
    if first is not None and not np.isfinite(np.asarray(first.float() if isinstance(first, torch.Tensor) else first)).all():
        raise Unavailable("produced non-finite output")
