"""python -m benchmarks.accuracy: the quantized whole models against fp32 eager PyTorch, side by side with
onnxruntime-genai's builds of the same weights, on one fixed prompt set (runtime/accuracy.py).

Uses the graphs `make bench` exports (benchmarks/.work/PRESET-lm, exported here if missing) and
writes benchmarks/accuracy.json and accuracy.md.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from models import build_model, preset
from runtime import accuracy
from runtime.artifacts import open_generator
from runtime.cli import Parser, run
from runtime.parity import reference_model

from .__main__ import prepare
from .peers import GenaiDriver
from .report import accuracy_markdown

TARGETS = ("ort", "ort-int4", "ort-int8", "npu-w8a16")
PEERS = ("genai-fp32", "genai-int4")
COLUMNS = ("max_rel", "mean_rel", "kl_mean", "kl_max", "top1", "greedy_match")


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="minimind", help="model config [minimind]")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads [all cores]")
    p.add_argument("--out", default="benchmarks", help="output folder [benchmarks]")
    return run(measure_all, p.parse_args(argv))


def measure_all(args) -> int:
    config, out = preset(args.preset), Path(args.out)
    folders = prepare(config, "lm", out / ".work" / f"{args.preset}-lm", list(PEERS), quantized=True)
    model = reference_model(build_model(config, "lm", seed=0))
    prompts = accuracy.prompt_set(config)
    refs = accuracy.references(model, prompts)
    rows = {}
    for target in TARGETS:
        rows[target] = accuracy.measure(open_generator(folders["lm"], target, provider="cpu", threads=args.threads),
                                        prompts, refs)
        print(_line(target, rows[target]), flush=True)
    for peer in PEERS:
        if not (folders[peer] / "genai_config.json").exists():
            print(f"{peer}: not built (onnxruntime-genai is not installed)")
            continue
        driver = GenaiDriver(folders[peer], args.threads, max_length=config.capacity)
        rows[peer] = accuracy.measure(driver, prompts, refs)
        print(_line(peer, rows[peer]), flush=True)
    doc = {"preset": args.preset, "reference": "eager PyTorch fp32, same weights", "prompts": rows["ort"]["prompts"],
           "decode_steps": accuracy.DECODE_STEPS, "results": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "accuracy.md").write_text(accuracy_markdown(doc))
    print(f"wrote {out / 'accuracy.json'}, {out / 'accuracy.md'}")
    return 0


def _line(name: str, r: dict) -> str:
    return f"{name:12s} " + ", ".join(f"{k} {r[k]:.3g}" for k in COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
