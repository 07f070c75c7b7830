"""python -m benchmarks.genai_generate FOLDER --prompt-ids 1,2,3: onnxruntime-genai's own generator, timed.

Greedy, on its builder's folder, timed the way `python -m runtime.generate --json` times ours, for benchmarks.fresh.

Its last line is the same JSON fields: open_ms (og.Model), time_to_first_token_ms (reading the prompt and choosing the
first token: append_tokens, then the generate_next_token that selects from the prompt's logits), decode_ms_steps (each
later generate_next_token: one decode step and its choice), their median and worst, generated_ids, and the
process's peak resident memory (peak_rss_bytes).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from runtime.cli import Parser, run
from runtime.cli import peak_rss_bytes
from runtime.generate import _ids

from .peers import genai_model


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.genai_generate", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="onnxruntime-genai's build (a folder with genai_config.json)")
    p.add_argument("--prompt-ids", type=_ids, required=True, metavar="1,2,3", help="the prompt as token ids")
    p.add_argument("--max-new-tokens", type=int, default=32, help="stop after this many new tokens [32]")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads; 0: all cores [0]")
    return run(_main, p.parse_args(argv))


def _main(args) -> int:
    import onnxruntime_genai as og
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}; expected at least 1")
    opening = time.perf_counter()
    model = genai_model(args.folder, args.threads)
    open_ms = (time.perf_counter() - opening) * 1e3
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(args.prompt_ids) + args.max_new_tokens, do_sample=False)
    gen = og.Generator(model, params)
    start = time.perf_counter()
    gen.append_tokens(np.array(args.prompt_ids, np.int32))
    gen.generate_next_token()
    out, first, steps = [int(gen.get_next_tokens()[0])], time.perf_counter(), []
    while len(out) < args.max_new_tokens and not gen.is_done():
        step = time.perf_counter()
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
        steps.append((time.perf_counter() - step) * 1e3)
    print(json.dumps({"target": "genai", "open_ms": open_ms, "generated_ids": out,
                      "time_to_first_token_ms": (first - start) * 1e3,
                      "decode_ms_median": float(np.median(steps)) if steps else None,
                      "decode_ms_worst": max(steps, default=None), "decode_ms_steps": steps,
                      "peak_rss_bytes": peak_rss_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
