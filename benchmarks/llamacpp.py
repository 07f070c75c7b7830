"""The llama.cpp peer, through llama-cpp-python: GGUFs of a trained Hugging Face Llama folder, and a driver over them.

Three GGUFs of the same weights: llamacpp-f32, converted from the folder by llama.cpp's own converter
(convert_hf_to_gguf.py --outtype f32, from the pinned sdist's vendored llama.cpp); llamacpp-q4_0, quantized from
that file by llama.cpp's llama_model_quantize (its default parameters); and llamacpp-q4_1, the folder's original
GGUF (the one its safetensors were dequantized from). llama-cpp-python builds from source (about 20 minutes on
2 cores), so `make test` does not install it: ensure_installed() builds it on first use, or says why it cannot.

Facts found on the way: with logits_all=False, Llama.eval keeps no logits (sampling reads them in place), so the
driver reads the last position's row from the context; Llama.reset() only sets n_tokens to 0, and the next eval
drops the cache rows past n_tokens; Llama(flash_attn=False) is DISABLED, not llama.cpp's own default (AUTO).
llama_cpp imports diskcache (a declared dependency, missing after `pip install --no-deps`). The converter imports
sentencepiece for every Llama folder, before it looks for a tokenizer.model, so it needs sentencepiece installed
even for a BPE tokenizer.json; it reads the folder with the vendored gguf-py, not the installed gguf. A native build
(GGML_NATIVE, the default) on a CPU reporting amx_tile compiles llama.cpp's AMX kernels in whatever GGML_AMX_* says,
and a VM that does not grant the process AMX tiles faults on them (faults() catches it); PORTABLE's flags build
without them.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from export.atomic import staged_dir
from models.fetch import sha256

LLAMA_CPP = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # PyPI's llama_cpp_python-0.3.36.tar.gz
ENGINES = ("llamacpp-f32", "llamacpp-q4_0", "llamacpp-q4_1")
ROOT = Path(__file__).resolve().parents[1]
# A build for this CPU's ISA without -march=native, which would compile the AMX kernels in (measured: 0.3.36 with only
# -DGGML_AMX_*=OFF still faulted in ggml_backend_amx_mul_mat; with these, Q4_0 and Q4_1 evaluate).
PORTABLE = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
            "-DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
# Reads a GGUF and evaluates a few tokens, in a subprocess (faults()).
PROBE = ("import sys, numpy as np; from benchmarks.llamacpp import LlamaCppDriver; "
         "d = LlamaCppDriver(sys.argv[1], threads=1, n_ctx=64); d.feed(np.array([[1, 2, 3, 4]])); d.decode(np.array([[5]]))")
BUILT = {"llamacpp-f32": "llamacpp-f32.gguf", "llamacpp-q4_0": "llamacpp-q4_0.gguf"}  # built into `out`; q4_1 is the folder's
STAMP = "built-from-weights"  # in `out`: the weights (and llama-cpp-python) every GGUF there was built from
# What convert_hf_to_gguf.py imports from its own tree: the per-architecture classes and the gguf-py it was written with.
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python cannot be imported or installed here; the message says why."""


def ensure_installed(log=print):
    """The llama_cpp module, pip-installed into this interpreter first if it does not import."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as e:
        log(f"llama_cpp does not import ({e}): installing {LLAMA_CPP}, built from source once "
            f"(about 20 minutes on 2 cores)")
    res = subprocess.run([sys.executable, "-m", "pip", "install", LLAMA_CPP], capture_output=True, text=True)
    if res.returncode != 0:
        raise LlamaCppUnavailable(f"pip install {LLAMA_CPP} failed: {_last_line(res.stderr)}")
    importlib.invalidate_caches()
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as e:
        raise LlamaCppUnavailable(f"{LLAMA_CPP} installed but llama_cpp does not import: {e}") from None


def build_ggufs(folder: Path, out: Path, log=print) -> dict[str, Path]:
    """Each engine's GGUF. Files in `out` are reused while its stamp names the same weights; otherwise all are rebuilt.
    The stamp is written before the files, so `out` never holds a file built from weights other than the stamp's."""
    folder, out = Path(folder), Path(out)
    originals = sorted(folder.glob("*.gguf"))
    if len(originals) != 1:
        raise FileNotFoundError(f"{folder}: {len(originals)} GGUF files; expected one, the original the weights came "
                                f"from (llamacpp-q4_1)")
    out.mkdir(parents=True, exist_ok=True)
    files = {engine: out / name for engine, name in BUILT.items()}
    stamp = weights_stamp(folder)
    if not ((out / STAMP).exists() and (out / STAMP).read_text() == stamp):
        for path in files.values():
            path.unlink(missing_ok=True)
        write_atomic(out / STAMP, lambda tmp: tmp.write_text(stamp))
    cache = out / f"converter-{LLAMA_CPP.partition('==')[2]}"  # the pin's converter: a new pin fetches its own
    steps = {"llamacpp-f32": lambda tmp: convert(folder, tmp, cache, log),
             "llamacpp-q4_0": lambda tmp: quantize(files["llamacpp-f32"], tmp, log)}
    for engine, path in files.items():
        if path.exists():
            log(f"{engine}: reusing {path}")
            continue
        start = time.perf_counter()
        write_atomic(path, steps[engine])
        log(f"{engine}: {path} built in {time.perf_counter() - start:.1f} s ({path.stat().st_size / 1e6:.0f} MB)")
    return files | {"llamacpp-q4_1": originals[0]}


def weights_stamp(folder: Path) -> str:
    """What the GGUFs are built from: the fetch record (it pins the weights) or else the weights' sha256, and the
    llama-cpp-python whose converter and quantizer build them."""
    fetched = folder / "FETCHED.json"
    weights = fetched.read_text() if fetched.exists() else sha256(folder / "model.safetensors")
    return json.dumps({"weights": weights, "llama_cpp": LLAMA_CPP})


def write_atomic(path: Path, write) -> None:
    """write(tmp) to a temporary name beside `path`, then rename it into place: an interrupted or failed write leaves
    no `path` for a later run to reuse."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def convert(folder: Path, dest: Path, cache: Path, log=print) -> None:
    """The folder as an F32 GGUF at `dest`, by llama.cpp's convert_hf_to_gguf.py in a subprocess."""
    script = converter(cache, log)
    res = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(dest), "--outtype", "f32"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}: {_last_line(res.stderr)}")


def converter(cache: Path, log=print) -> Path:
    """convert_hf_to_gguf.py and what it imports, extracted from the pinned sdist into `cache` once."""
    script = cache / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    log(f"fetching llama.cpp's converter from the {LLAMA_CPP} sdist")
    with staged_dir(cache) as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP,
                              "--dest", str(tmp), "--disable-pip-version-check", "--progress-bar", "off"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise LlamaCppUnavailable(f"pip download {LLAMA_CPP} failed: {_last_line(res.stderr)}")
        (sdist,) = tmp.glob("*.tar.gz")
        digest = sha256(sdist)
        if digest != SDIST_SHA256:  # the converter runs as code: only the sdist this module was checked with
            raise LlamaCppUnavailable(f"{sdist.name}: sha256 {digest}; expected the pinned {SDIST_SHA256}")
        extract_converter(sdist, tmp)
        sdist.unlink()
    return script


def extract_converter(sdist: Path, dest: Path) -> None:
    """CONVERTER's files from the sdist's vendor/llama.cpp into `dest`, and nothing else (not llama.cpp's sources)."""
    with tarfile.open(sdist) as tar:
        members = [m.replace(name=rel, deep=False) for m in tar.getmembers()
                   if (rel := m.name.partition("/vendor/llama.cpp/")[2]).startswith(CONVERTER)]
        if not any(m.name == CONVERTER[0] for m in members):
            raise LlamaCppUnavailable(f"{sdist.name}: no vendor/llama.cpp/{CONVERTER[0]}")
        tar.extractall(dest, members=members, filter="data")


def quantize(src: Path, dest: Path, log=print) -> None:
    """`src` (F32 GGUF) quantized to Q4_0 at `dest` by llama.cpp, its default quantize parameters otherwise."""
    llama_cpp = ensure_installed(log)
    # llama-cpp-python prints llama.cpp's log through this logger; errors only, as Llama(verbose=False) sets it
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} (Q4_0)")


def faults(path: Path, timeout: float = 600) -> str | None:
    """None where llama.cpp reads `path` and evaluates a few tokens in a subprocess; else why not, in one line.
    llama.cpp's CPU kernels die by a signal rather than raise where the CPU faults on them, and in-process that ends
    the whole benchmark (measured: a VM whose CPU reports amx_tile and AVX-512 took a general protection fault in
    libggml-cpu on the first Q4_0 or Q4_1 evaluation of a native build; F32 ran)."""
    try:
        res = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, cwd=ROOT,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not evaluate {Path(path).name} within {timeout:g} s"
    if res.returncode == 0:
        return None
    how = f"killed by {signal.Signals(-res.returncode).name}" if res.returncode < 0 else \
        f"exit {res.returncode}: {_last_line(res.stderr)}"
    return f"llama.cpp failed to evaluate {Path(path).name} on this CPU ({how}); where it is its AMX kernels, " \
        f"CMAKE_ARGS=\"{PORTABLE}\" pip install --force-reinstall --no-deps {LLAMA_CPP} builds one without them"


class LlamaCppDriver:
    """A GGUF through llama-cpp-python behind the runtime drivers' reset/feed/decode (runtime/accuracy.py): feed reads
    a prompt [1, L] into an empty cache and returns the next-token logits [1, 1, V], decode appends one token. Plus the
    benchmark's two timings, prefill_runner and decode_runner."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 2048):
        llama_cpp = ensure_installed()
        # llama-cpp-python's defaults otherwise: n_batch = n_ubatch = 512 (a longer prompt is read 512 tokens at a
        # time), flash attention off, an f16 KV cache, the weights mmapped.
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()

    def feed(self, ids: np.ndarray) -> np.ndarray:
        self.llm.reset()
        return self.decode(ids)

    def decode(self, ids: np.ndarray) -> np.ndarray:
        self.llm.eval(ids[0].tolist())
        return self._logits()

    def _logits(self) -> np.ndarray:
        """The last evaluated position's logits, copied: the context overwrites them on the next eval."""
        row = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,)).reshape(1, 1, -1).copy()

    def prefill_runner(self, ids: np.ndarray):
        """Time to first token: a no-argument callable reading the prompt ids [1, N] into an empty cache."""
        return lambda: self.feed(ids)

    def decode_runner(self, ids: np.ndarray):
        """One token at context p0 = ids' length, again and again: the context is read once, then each run goes back
        to p0 cached tokens (eval drops the rows past n_tokens) and reads the greedy next token."""
        p0, token = ids.shape[1], [int(np.argmax(self.feed(ids)))]

        def step():
            self.llm.n_tokens = p0
            self.llm.eval(token)
            return self._logits()
        return step


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:240] if lines else "no message"
