"""python -m export: export a model's prefill and decode graphs with their manifest.

Every AttentionConfig field has a flag; unset flags keep the preset's value.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from pathlib import Path

from models import KINDS, PRESETS, AttentionConfig, preset
from runtime.cli import Parser, peak_rss_bytes, run

from .exporter import export_model
from .quantize import parse as parse_quant
from .windows import parse as parse_windows
from .torch_export import DEFAULT_OPSET


def _config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config overrides (default: the preset's value, shown for minimind)")
    for f in dataclasses.fields(AttentionConfig):
        meta, default = f.metadata, PRESETS["minimind"].to_dict()[f.name]
        kwargs = {"dest": f.name, "default": None, "help": f"{meta['help']} [{default}]".replace("%", "%%")}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=type(default), metavar=type(default).__name__.upper(), choices=meta["choices"])
            if meta["choices"]:
                kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}"
        group.add_argument(f"--{meta['flag']}", **kwargs)


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m export",
        description="Export an attention block (or MiniMind decoder block) to two static ONNX graphs, "
                    "prefill (T = chunk) and decode (T = 1), over a fixed-capacity KV cache, with "
                    "manifest.json. Each graph is checked (onnx.checker, static shapes, parity against "
                    "eager PyTorch in onnxruntime) before anything is written.")
    p.add_argument("--preset", default="minimind", choices=sorted(PRESETS), help="named config to start from [minimind]")
    p.add_argument("--kind", default="attention", choices=list(KINDS),
                   help="attention: the attention block; block: the MiniMind decoder block (norm, attention, SwiGLU); "
                        "lm: the whole causal language model (embedding, L blocks, norm, tied lm_head) [attention]")
    p.add_argument("--out", help="output folder [artifacts/PRESET, or artifacts/PRESET-KIND for --kind block/lm; "
                   "artifacts/NAME-lm for --kind lm --weights NAME]")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and the parity inputs [0]")
    p.add_argument("--weights", metavar="PATH", help="a MiniMind state dict (.pt/.pth) to load instead of random "
                   "weights; for --kind lm also a Hugging Face folder (config.json + safetensors), whose config.json "
                   "gives the dims: a MiniMind or Qwen3 folder is built as the course model, any other decoder-only "
                   "causal LM with softmax attention from transformers' own modeling code (see --source)")
    p.add_argument("--layer", type=int, metavar="N", help="with a full MiniMind checkpoint: which model.layers.N to take")
    p.add_argument("--quant", default="none", metavar="SCHEMES",
                   help="quantized targets to add, comma-separated: int4, int8 (ort: MatMulNBits weights), w8a16 "
                        "(npu: QDQ, calibrated); none [none]")
    p.add_argument("--windows", default="auto", metavar="SIZES",
                   help="the window ladder: comma-separated cache row counts each step is also exported over (the "
                        "capacity always included); auto: 256, 512, ... below the capacity; none: the capacity only [auto]")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset of the exported graphs [{DEFAULT_OPSET}]")
    _config_flags(p)
    return p


def main(argv=None) -> int:
    return run(_export, parser().parse_args(argv))


def _export(args) -> int:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(AttentionConfig) if getattr(args, f.name) is not None}
    config = preset(args.preset, **overrides)
    name = Path(args.weights).stem if args.kind == "lm" and args.weights else args.preset
    out = args.out or f"artifacts/{name}" + (f"-{args.kind}" if args.kind != "attention" else "")
    export_model(config, out, kind=args.kind, seed=args.seed, weights=args.weights, layer=args.layer, opset=args.opset,
                 quant=parse_quant(args.quant), windows=parse_windows(args.windows, config), log=partial(print, flush=True),
                 bar=sys.stderr.isatty())
    if (peak := peak_rss_bytes()) is not None:
        print(f"peak memory: {peak / 2**30:.2f} GiB", flush=True)  # this process's own (VmHWM); benchmarks.scale reads it
    return 0


if __name__ == "__main__":
    sys.exit(main())
