"""Text generation with an exported whole model: python -m runtime.generate FOLDER [--target ...] --chat TEXT
(or --prompt TEXT, or --prompt-ids 1,2,3)

The prompt is fed in chunks (its last token the last row of a step, so that step's logits
are the next token's), then one decode step per new token, over caches the runtime owns
(bound in place for onnx/ort, host-owned for npu). Tokens are chosen greedily, or sampled
the way MiniMind's own `generate` does: repetition penalty, temperature, top-k, top-p
(nucleus), from a seeded generator. Generation stops at an end-of-sequence token, after
`max_new_tokens`, or when the cache is full (a clear stop, not an error).

Text goes through the tokenizer the export copied from the Hugging Face folder (runtime/text.py, transformers'
AutoTokenizer): `--chat` wraps a user message in the folder's chat template, `--prompt` encodes plain text, and the
generated tokens are printed as text while they come (ids, where the folder has no tokenizer).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

import registry

from .artifacts import ArtifactError, load_manifest, open_generator
from .cli import Parser, peak_rss_bytes, run
from .drivers import Driver
from .session import one_pool
from .text import TextError, TextStream, chat_ids, has_tokenizer, load_tokenizer, prompt_ids


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: every token
    top_p: float = 1.0                # 1: every token
    repetition_penalty: float = 1.0   # 1: none; > 1 makes tokens already in the sequence less likely
    seed: int = 0

    def __post_init__(self):
        for name, ok, want in (("temperature", self.temperature >= 0, ">= 0"), ("top_k", self.top_k >= 0, ">= 0"),
                               ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                               ("repetition_penalty", self.repetition_penalty > 0, "> 0")):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)}; expected {want}")


def choose(logits: np.ndarray, seen: list[int], sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from one position's logits [V]."""
    logits = logits.astype(np.float64)
    if sampling.repetition_penalty != 1.0 and seen:  # as transformers (and MiniMind) apply it: on the logits
        ids = np.unique(seen)
        picked = logits[ids]
        logits[ids] = np.where(picked > 0, picked / sampling.repetition_penalty, picked * sampling.repetition_penalty)
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.size:
        logits[logits < np.partition(logits, -sampling.top_k)[-sampling.top_k]] = -np.inf
    if sampling.top_p < 1.0:  # keep the smallest set of most likely tokens whose probability reaches top_p
        order = np.argsort(-logits)
        probs = np.exp(logits[order] - logits[order[0]])
        cumulative = np.cumsum(probs / probs.sum())
        drop = order[1:][cumulative[:-1] >= sampling.top_p]
        logits[drop] = -np.inf
    probs = np.exp(logits - logits.max())
    return int(rng.choice(logits.size, p=probs / probs.sum()))


def generate(driver: Driver, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             eos: tuple[int, ...] = (), on_token=None) -> dict:
    """Generate up to `max_new_tokens` after `prompt` (batch 1); `on_token(id)` is called as each one comes."""
    if driver.batch != 1:
        raise ValueError(f"the graphs take batch {driver.batch}; generation runs one sequence (export with --batch 1)")
    if not prompt:
        raise ValueError("empty prompt; expected at least one token id")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; expected at least 1")
    if len(prompt) >= driver.capacity:
        raise ValueError(f"prompt of {len(prompt)} tokens; the cache holds {driver.capacity}, expected a shorter prompt")
    rng, out, stop, steps, windows = np.random.default_rng(sampling.seed), [], "max_new_tokens", [], []
    driver.reset()
    start = time.perf_counter()
    logits = driver.feed(np.array([prompt], np.int64))
    first, prompt_window = time.perf_counter(), driver.window
    while True:
        token = choose(logits[0, -1], prompt + out, sampling, rng)
        out.append(token)
        if on_token:
            on_token(token)
        if token in eos:
            stop = "eos"
            break
        if len(out) == max_new_tokens:
            break
        if driver.position >= driver.capacity:
            stop = "capacity"
            break
        step = time.perf_counter()
        logits = driver.decode(np.array([[token]], np.int64))
        steps.append((time.perf_counter() - step) * 1e3)
        windows.append(driver.window)
    end = time.perf_counter()
    decode_s = end - first
    return {"prompt_ids": list(prompt), "generated_ids": out, "stop": stop, "time_to_first_token_ms": (first - start) * 1e3,
            "prompt_window": prompt_window,
            "decode_ms_per_token": decode_s * 1e3 / max(len(out) - 1, 1),
            "decode_ms_median": float(np.median(steps)) if steps else None,
            "decode_ms_worst": max(steps, default=None), "decode_ms_steps": steps, "decode_windows": windows,
            "tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0}


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids, e.g. 1,2,3") from None


def parser() -> Parser:
    p = Parser(prog="python -m runtime.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="an export of the whole model (python -m export --kind lm)")
    p.add_argument("--target", default=registry.RUN_BY_DEFAULT, choices=tuple(registry.TARGETS),
                   help="which graphs run; the quantized ones where the export wrote them (--quant) "
                        f"[{registry.RUN_BY_DEFAULT}]")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=_ids, metavar="1,2,3", help="the prompt as token ids")
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as plain text (needs a tokenizer)")
    prompt.add_argument("--chat", metavar="MESSAGE", help="a user message, wrapped in the tokenizer's chat template "
                        "with the assistant's turn opened (needs a tokenizer with a chat template)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a folder with Hugging Face tokenizer files, or one tokenizer.json [FOLDER, when the export "
                        "copied the tokenizer]")
    p.add_argument("--max-new-tokens", type=int, default=32, help="stop after this many new tokens [32]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; above 0 samples [0]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all [0]")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens up to this "
                   "probability mass [1.0]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens [1.0]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler [0]")
    p.add_argument("--eos", type=_ids, metavar="ID[,ID]", help="end-of-sequence token id(s) [the manifest's, if any]")
    p.add_argument("--provider", default="auto", choices=("cpu", "cuda", "auto"), help="onnxruntime device [auto]")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads; 0: all cores [0]")
    p.add_argument("--json", action="store_true", help="end with one JSON line: generated_ids, open_ms (opening the "
                   "model), time_to_first_token_ms, decode_ms_median, decode_ms_worst, decode_ms_steps, the window each "
                   "step ran over (prompt_window, decode_windows), tokens_per_s, peak_rss_bytes (the process's peak "
                   "resident memory, Linux)")
    return p


def main(argv=None, process: bool = False) -> int:
    """`process`: this process is the command's own (python -m runtime.generate), so its sessions share one thread
    pool (runtime/session.one_pool)."""
    args = parser().parse_args(argv)
    args.one_pool = process
    return run(_main, args)


def _main(args) -> int:
    manifest = load_manifest(args.folder)
    if manifest.get("kind") != "lm":
        raise ArtifactError(f"{args.folder}: an export of kind {manifest.get('kind')!r}; expected the whole model "
                            "(python -m export --kind lm)")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
    tokenizer = _tokenizer(args)
    if args.chat is not None:
        prompt = chat_ids(tokenizer, args.chat, args.tokenizer or args.folder)
    elif args.prompt is not None:
        prompt = prompt_ids(tokenizer, args.prompt)
    else:
        prompt = args.prompt_ids
    if not prompt:
        raise ValueError("empty prompt; expected at least one token")
    vocab = manifest["config"]["vocab_size"]
    if any(not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt ids {prompt[:8]}...: expected ids in 0..{vocab - 1}")
    opening = time.perf_counter()
    if args.one_pool:
        one_pool(args.threads)
    driver = open_generator(args.folder, args.target, provider=args.provider, threads=args.threads)
    open_ms = (time.perf_counter() - opening) * 1e3
    eos = tuple(args.eos if args.eos is not None else manifest["lm"].get("eos_token_ids", []))
    stream = TextStream(tokenizer, eos) if tokenizer is not None else _IdStream()
    result = generate(driver, prompt, args.max_new_tokens, sampling, eos, on_token=stream)
    stream.end()
    print(f"{len(result['generated_ids'])} tokens ({result['stop']}): time to first token "
          f"{result['time_to_first_token_ms']:.1f} ms, {result['tokens_per_s']:.1f} tokens/s")
    if args.json:
        print(json.dumps({"target": args.target, "open_ms": open_ms, **result, "peak_rss_bytes": peak_rss_bytes()}))
    return 0


def _tokenizer(args):
    """The tokenizer (--tokenizer, else the export folder's), or None for --prompt-ids where there is none."""
    text = "--chat" if args.chat is not None else "--prompt" if args.prompt is not None else None
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    if has_tokenizer(args.folder):
        return load_tokenizer(args.folder)
    if text:
        raise TextError(f"{text} needs a tokenizer; {args.folder} has none (export from a Hugging Face folder with "
                        "tokenizer.json, or pass --tokenizer PATH), or give the prompt as --prompt-ids")
    return None


class _IdStream:
    """Prints token ids as they come, where there is no tokenizer."""

    def __call__(self, token: int) -> None:
        print(token, end=" ", flush=True)

    def end(self) -> None:
        print(flush=True)


if __name__ == "__main__":
    sys.exit(main(process=True))
