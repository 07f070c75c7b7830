"""The peer for the whole model: onnxruntime-genai's model builder, run on the same weights.

Our LM is written as a Hugging Face Qwen3 folder (its architecture; with a tiny trained
tokenizer, which the builder needs), a trained model's folder is taken as it was fetched, and each
is built twice, `-p fp32 -e cpu` and `-p int4 -e cpu`, with the builder's own defaults otherwise. Facts found on the way: onnxruntime-genai 0.18.0
takes onnxruntime >= 1.31; its builder imports onnx_ir without declaring it; its `--help`
crashes on a `%` in the help text, so it is only ever called with its arguments.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

PRECISIONS = {"genai-fp32": "fp32", "genai-int4": "int4"}


def build_genai(model, folder: Path, engines) -> None:
    """folder/hf (the weights as Qwen3) and the builder's output for each engine (folder/genai-fp32, ...). A
    machine without onnxruntime-genai gets no builds; its engines then say so."""
    # Imported here: they import torch, and benchmarks.genai_generate (this module's genai_model) measures its own
    # peak memory, which torch's 250 MB would inflate.
    from corpus.text import save_tokenizer
    from models.checkpoint import save_hf_folder
    hf = save_hf_folder(model, folder / "hf")
    save_tokenizer(hf, min(model.config.vocab_size, 512))
    for engine in engines:
        run_builder(hf, folder / engine, engine, folder / "genai-cache")


def run_builder(hf: Path, out: Path, engine: str, cache: Path) -> None:
    """onnxruntime-genai's model builder on the Hugging Face folder `hf`, at the engine's precision, for the CPU,
    into `out`; nothing where onnxruntime-genai is not installed (its engines then say so)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return
    precision = PRECISIONS[engine]
    res = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                          "-p", precision, "-e", "cpu", "-c", str(cache)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai's builder failed for {precision}: "
                           f"{(res.stderr.strip().splitlines() or ['no message'])[-1][:200]}")


def genai_model(folder: Path, threads: int):
    """onnxruntime-genai's model over its build in `folder`, on `threads` intra-op threads (0: all cores)."""
    import onnxruntime_genai as og
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    return og.Model(config)


class GenaiDriver:
    """onnxruntime-genai's build behind the runtime drivers' reset/feed/decode, for runtime/accuracy.py: feed reads a
    prompt and returns the next-token logits [1, 1, V], decode appends one token (teacher forcing or greedy)."""

    def __init__(self, folder: Path, threads: int, max_length: int):
        import onnxruntime_genai as og
        self._og, self.max_length = og, max_length
        self.model, self.generator = genai_model(folder, threads), None

    def reset(self) -> None:
        self.generator = None

    def feed(self, ids: np.ndarray) -> np.ndarray:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_length, do_sample=False)
        self.generator = self._og.Generator(self.model, params)
        return self.decode(ids)

    def decode(self, ids: np.ndarray) -> np.ndarray:
        self.generator.append_tokens(ids[:1].astype(np.int32))
        return np.asarray(self.generator.get_logits()).reshape(1, 1, -1)
