"""make handoff: a self-checking bundle for NPU toolchains, in artifacts/<name>/handoff/.

For the attention block and the decoder block: the `npu` graphs in fp32 and fp16 and the
`onnx` graphs in fp32 (each with the export's own manifest), golden vectors (inputs and
eager-PyTorch outputs for a prefill chunk and 8 decode steps), the lint report, which
runtimes accept which target (measured by running the golden vectors), and a README for
the receiving engineer. The whole model (`lm`) adds its `npu` graphs in fp32 and fp16, with
goldens for a prompt chunk and 8 decode steps on eager PyTorch's greedy tokens (stored with
them); its goldens hold only the cache rows written before a graph's first step: the verifier
keeps the L caches as a host would, writing each step's reference rows. `python -m runtime.verify BUNDLE` re-checks it from the bundle alone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from models import AttentionConfig, build_model, preset
from models.contract import cache_names, input_names, output_names
from passes.lint import lint
from passes.lower_npu import MASK_VALUE
from runtime import qnn
from runtime.drivers import host_mask
from runtime.cli import Parser, run
from runtime.parity import TOLERANCE, reference_model
from runtime.verify import available_runtimes, verify_graph

from . import quantize, windows as ladders
from .atomic import staged_dir
from .exporter import export_model

# Per kind: (dtype, targets); a quantized target (npu-w8a16) shares its float graph's folder and weights file.
VARIANTS = {"attention": (("fp32", ("onnx", "npu")), ("fp16", ("npu",))),
            "block": (("fp32", ("onnx", "npu")), ("fp16", ("npu",))),
            "lm": (("fp32", ("npu", "npu-w8a16")), ("fp16", ("npu",)))}
KINDS = tuple(VARIANTS)
DECODE_STEPS = 8


def golden(model, config: AttentionConfig, target: str, kind: str = "attention", seed: int = 0) -> dict[str, list]:
    """Per step graph: [(inputs, eager outputs, rows written)] for a prefill chunk at 0, then decode steps (the
    lm's on its own greedy tokens, stored as `greedy`; its npu goldens leave the caches to the verifier)."""
    reference, np_dtype = reference_model(model), "float16" if config.dtype == "fp16" else "float32"
    t, b, lm = config.chunk, config.batch, kind == "lm"
    gen = torch.Generator().manual_seed(seed)
    if lm:
        x = torch.randint(0, config.vocab_size, (b, t), generator=gen)
    else:
        x = torch.randn(b, t + DECODE_STEPS, config.hidden_size, generator=gen).to(config.torch_dtype).float()
    names, outs = input_names(config, kind), output_names(config, kind)
    npu = target.startswith("npu")
    cache = [torch.zeros(b, config.num_kv_heads, config.capacity, config.head_dim) for _ in names[2:]]
    steps = {"prefill": [], "decode": []}
    for step, p0, n in [("prefill", 0, t)] + [("decode", t + i, 1) for i in range(DECODE_STEPS)]:
        pos = (p0 + torch.arange(n)).expand(b, n)
        inp = x if lm else x[:, p0:p0 + n]
        with torch.no_grad():
            out, *presents = reference(inp, pos, *cache)
        feeds = {names[0]: inp.numpy().astype("int32" if npu else "int64") if lm else inp.numpy().astype(np_dtype),
                 "position_ids": pos.numpy().astype("int32" if npu else "int64")}
        want = {outs[0]: out.numpy()}
        if npu:
            feeds["attention_mask"] = host_mask(b, config.capacity, p0, n, quantize.mask_value(target), np_dtype)
            want |= {new: p[:, :, p0:p0 + n].numpy() for new, p in zip(cache_names(config, kind, ""), presents)}
        else:
            want |= {name: p.numpy() for name, p in zip(outs[1:], presents)}
        if not (lm and npu):
            feeds |= {name: c.numpy().astype(np_dtype) for name, c in zip(names[2:], cache)}
        elif not steps[step] and p0:  # the rows a host holds before this graph's first step: its cache's start
            feeds |= {name: c[:, :, :p0].numpy().astype(np_dtype) for name, c in zip(names[2:], cache)}
        if lm:
            x = out[:, -1].argmax(-1, keepdim=True)
            want["greedy"] = x.numpy()
        steps[step].append((feeds, want, p0 + n))
        cache = presents
    return steps


def _goldens(model, config: AttentionConfig, kind: str, target: str, folder: str, suffix: str, seed: int,
             tmp: Path) -> list[dict]:
    """The bundle entries (and golden files) of one target's two step graphs over `config.capacity` rows."""
    entries = []
    for step, steps in golden(model, config, target, kind, seed).items():
        name = f"{folder}/{step}.{target}{suffix}"
        save_golden(tmp / f"{name}.golden.npz", steps)
        entries.append({"file": f"{name}.onnx", "golden": f"{name}.golden.npz", "kind": kind, "dtype": config.dtype,
                        "target": target, "step": step, "window": config.capacity,
                        "tolerance": quantize.tolerance(target, TOLERANCE[config.dtype])}
                       | ({"quantized": quantize.describe(quantize.split(target)[1])}
                          if quantize.split(target)[1] else {})
                       | ({"host_cache": {"inputs": cache_names(config, kind, "past_"),
                                          "shape": [config.batch, config.num_kv_heads, config.capacity, config.head_dim]}}
                          if kind == "lm" else {}))
    return entries


def save_golden(path: Path, steps: list) -> None:
    arrays = {"steps": np.array(len(steps))}
    for i, (feeds, want, live) in enumerate(steps):
        arrays |= {f"in.{i}.{k}": v for k, v in feeds.items()} | {f"out.{i}.{k}": v for k, v in want.items()}
        arrays[f"live.{i}"] = np.array(live)
    np.savez_compressed(path, **arrays)


def build(config: AttentionConfig, out: str | Path, kinds=KINDS, seed: int = 0, socs=qnn.SOCS,
          windows: tuple[int, ...] = (), log=print) -> dict:
    """The bundle, every graph over each window of the ladder (`windows`; default: export/windows.py's)."""
    out = Path(out)
    socs = tuple(socs) if qnn.available() else ()
    ladder = ladders.check(tuple(windows) or ladders.default(config), config)
    if short := [w for w in ladder if w < config.chunk + DECODE_STEPS]:
        raise ladders.WindowError(f"windows {short}: a golden holds a prefill chunk and {DECODE_STEPS} decode steps; "
                                  f"expected W >= {config.chunk + DECODE_STEPS}")
    with staged_dir(out) as tmp:
        graphs = []
        for kind in kinds:
            for dtype, targets in VARIANTS[kind]:
                c, folder = config.replace(dtype=dtype), f"{kind}-{dtype}"
                schemes = [quantize.split(t)[1] for t in targets]
                exported = export_model(c, tmp / folder, kind=kind, seed=seed, windows=ladder, log=lambda *_: None,
                                        targets=tuple(t for t, q in zip(targets, schemes) if not q),
                                        quant=tuple(q for q in schemes if q))
                model = build_model(c, kind, seed)
                for target in targets:
                    for w in sorted({g["window"] for g in exported["graphs"] if g["target"] == target}):
                        graphs += _goldens(model, c.replace(capacity=w), kind, target, folder, ladders.suffix(w, c), seed, tmp)
                log(f"exported {folder}: {', '.join(targets)} graphs with golden vectors")
        for g in (g for g in graphs if g["target"].startswith("npu") and socs):
            compiled = {soc: g["file"].replace(".onnx", f".qnn{soc}.onnx") for soc in socs}
            g["qnn"] = {str(soc): {"file": f} | qnn.compile_graph(tmp / g["file"], soc, tmp / f, fp16="quantized" not in g)
                        for soc, f in compiled.items()}
            log(f"compiled {g['file']} for the QNN HTP of SoC {', '.join(map(str, socs))}")
        profile = lambda g: quantize.split(g["target"])[0]  # noqa: E731
        lints = {g["file"]: {"violations": [vars(v) for v in lint(tmp / g["file"], profile(g))],
                             "notes": [vars(v) for v in lint(tmp / g["file"], profile(g), notes=True)]} for g in graphs}
        runtimes = {rt: {t: all(verify_graph(tmp, g, rt)["ok"] for g in graphs if g["target"] == t)
                         for t in dict.fromkeys(g["target"] for g in graphs)} for rt in available_runtimes(socs)}
        if not all(runtimes["onnxruntime"].values()) or any(lints[g["file"]]["violations"] for g in graphs):
            raise RuntimeError(f"bundle check failed: onnxruntime {runtimes['onnxruntime']}, lint {lints}")
        manifest = {"format": 1, "config": config.to_dict(), "kinds": list(kinds), "windows": list(ladder),
                    "contract": CONTRACT,
                    "graphs": graphs, "runtimes": runtimes, "lint": "lint.json",
                    "qnn": {"version": qnn.version(), "socs": list(socs), "soc_names": {str(s): qnn.SOC_NAMES.get(s, "")
                                                                                      for s in socs},
                            "emulated": "compiled and run in host emulation of the HTP, not on a phone",
                            "precision": "float graphs in fp16 (enable_htp_fp16_precision=1), judged at 1e-2; QDQ graphs "
                                         "(npu-w8a16) as quantized, judged at their accuracy budget"}
                    if socs else {"socs": [], "note": "onnxruntime-qnn is not installed: nothing compiled for the HTP"}}
        (tmp / "lint.json").write_text(json.dumps(lints, indent=2) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(readme(config, runtimes, manifest["qnn"], list(ladder)))
    log(f"wrote {out}: {len(graphs)} graphs; accepted by " +
        "; ".join(f"{rt}: {', '.join(t for t, ok in r.items() if ok) or 'none'}" for rt, r in runtimes.items()))
    return manifest


CONTRACT = {
    "npu": {
        "inputs": "hidden_states [B,T,E]; position_ids [B,T] int32 (p0..p0+T-1); attention_mask [B,1,T,C+T] additive; "
                  "past_key, past_value [B,Hkv,C,D]",
        "outputs": "output [B,T,E]; key, value [B,Hkv,T,D]: the step's new rows (K after q/k norm and RoPE)",
        "mask": f"column j < C: 0 if j < p0 else {MASK_VALUE}; column C+t': 0 for query t if t' <= t else {MASK_VALUE}",
        "mask_value": MASK_VALUE,
        "cache_update": "host writes key/value into rows p0..p0+T-1 of its [B,Hkv,C,D] buffers after each step",
        "rope": "non-interleaved rotate_half; cos/sin gathered in the graph from constant tables by position_ids",
        "gqa": "query heads grouped as [B,Hkv,(H/Hkv)*T,D] against [B,Hkv,C+T,D]; K/V never repeated",
        "opset": 17,
    },
    "lm_npu": {
        "inputs": "input_ids [B,T] int32; position_ids [B,T] int32; attention_mask [B,1,T,C+T] additive (one for "
                  "every layer); past_key.i, past_value.i [B,Hkv,C,D] for each layer i",
        "outputs": "logits [B,1,V] at the step's last position; key.i, value.i [B,Hkv,T,D]: each layer's new rows",
        "prompt": "feed a prompt so that its last token is the last row of a step: a partial chunk first (pad its "
                  "end; the next chunk overwrites those rows), or, shorter than T, all but its last token as one "
                  "padded chunk and the last token as a decode step",
        "weights": "weights.data beside the graphs (ONNX external data), shared by prefill and decode",
        "quantized": f"npu-w8a16: the same step in QDQ form (opset 21), attention_mask entries {quantize.QDQ_MASK_VALUE} "
                     f"instead of {MASK_VALUE}",
    },
    "onnx": {
        "inputs": "hidden_states [B,T,E]; position_ids [B,T] int64; past_key, past_value [B,Hkv,C,D]",
        "outputs": "output [B,T,E]; present_key, present_value [B,Hkv,C,D]: past with rows p0..p0+T-1 written; "
                   "later rows unspecified",
        "opset": 24,
    },
}


def readme(config: AttentionConfig, runtimes: dict, htp: dict, windows: list[int]) -> str:
    accepted = "\n".join(f"- {rt}: " + ", ".join(f"`{t}` {'yes' if ok else 'no'}" for t, ok in r.items())
                         for rt, r in runtimes.items())
    deploy = "\n".join(f"| {soc} | {htp['soc_names'][str(soc)]} | `*.npu.qnn{soc}.onnx` |" for soc in htp["socs"])
    compiled = (f"Every npu graph is also compiled for the Hexagon NPU (HTP) of each SoC below with {htp['version']}, "
                "every node on the HTP (CPU fallback disabled), as an `EPContext` model beside it: load that file with "
                "onnxruntime's QNN execution provider on a device with that chip, and nothing is compiled on the device. "
                "The HTP runs the float graphs in fp16. They were compiled and checked in QNN's host emulation of the "
                "HTP, not on a phone.") if htp["socs"] else htp["note"]
    QDQ_MASK = quantize.QDQ_MASK_VALUE  # noqa: N806
    return f"""# Attention hand-off bundle

MiniMind's attention block, decoder block and whole causal language model (E={config.hidden_size},
H={config.num_heads}, Hkv={config.num_kv_heads}, D={config.head_dim}, {config.num_layers} layers, vocabulary
{config.vocab_size}, cache C={config.capacity} rows, prefill chunk T={config.chunk}, batch {config.batch}), random
weights (seed 0), as static ONNX graphs.

| folder | graphs |
|---|---|
| `attention-fp32/`, `block-fp32/` | `prefill.npu.onnx`, `decode.npu.onnx` (opset 17), `prefill.onnx.onnx`, `decode.onnx.onnx` (opset 24) |
| `attention-fp16/`, `block-fp16/` | `prefill.npu.onnx`, `decode.npu.onnx` in fp16 |
| `lm-fp32/`, `lm-fp16/` | the whole model's `prefill.npu.onnx`, `decode.npu.onnx`, their weights in `weights.data` |
| `lm-fp32/` | also `prefill.npu-w8a16.onnx`, `decode.npu-w8a16.onnx`: the same steps quantized (QDQ, opset 21) |

The quantized (QDQ) graphs hold QuantizeLinear/DequantizeLinear pairs around every op: weights int8 symmetric
per output channel, activations uint16 with ranges calibrated on activations recorded from real forward passes
(the calibration set and method are in each export's `manifest.json`). Their mask value is {QDQ_MASK}, not
{MASK_VALUE}, so the 16-bit scores keep their resolution. They are judged against eager fp32 at their accuracy
budget (`tolerance` in manifest.json), not at 1e-4; the measured accuracy is in `lm-fp32/manifest.json`.

Context windows: every float graph is there once per window W of the ladder {windows} (C's keep the names above,
the others add `.wW`: `decode.npu.w{windows[0]}.onnx`), all reading the same `weights.data`. Window W's graphs take
caches `[B,Hkv,W,D]` and an attention_mask `[B,1,T,W+T]` (C replaced by W below) and cost what W rows cost, not
C: run each step in the smallest W with p0+T <= W, and when W grows, move rows 0..p0-1 into the larger buffers.
The QDQ graphs are over C only.

Every graph has a `*.golden.npz` beside it: inputs and eager-PyTorch (fp32) outputs for a prefill chunk at
position 0 (prefill graphs) or 8 decode steps after it (decode graphs); the whole model's decode steps feed
eager PyTorch's greedy tokens (stored as `greedy`), and its goldens leave the L caches out but for the rows
written before a graph's first step: the verifier keeps them as your host would, writing each step's reference
rows. Check them with
`python -m runtime.verify .` (needs only numpy, onnxruntime and, optionally, openvino). Tolerance: fp32 1e-4,
fp16 1e-2 (absolute, or relative to the output's largest value).

## The npu step

```
npu_step(hidden_states [B,T,E], position_ids [B,T] int32, attention_mask [B,1,T,C+T],
         past_key [B,Hkv,C,D], past_value [B,Hkv,C,D]) -> output [B,T,E], key [B,Hkv,T,D], value [B,Hkv,T,D]
```

- You own the cache: start with zeros; after a step at positions p0..p0+T-1, write `key`/`value` into rows
  p0..p0+T-1. A prompt longer than T goes in chunks of T (pad the last one; ignore padded outputs).
- `attention_mask` is additive and finite: column j < C is 0 if j < p0 else {MASK_VALUE}; column C+t' is 0 for
  query t if t' <= t else {MASK_VALUE}. Finite, so no row turns into NaN in fp16.
- RoPE is applied inside the graph (non-interleaved rotate_half) from constant cos/sin tables indexed by the
  int32 `position_ids`; V is not rotated.
- GQA groups the query heads ([B,Hkv,(H/Hkv)*T,D] against [B,Hkv,C+T,D]); K/V are never repeated.
- Static primitives only: no If/Loop/Scan, Shape/Range/ConstantOfShape/NonZero, scatter, Expand/Tile or
  computed Reshape; no infinities; no boolean inputs (see `lint.json`: no violations; its notes say what a
  toolchain must be told, e.g. that QNN's HTP compiles the fp32 RoPE and embedding tables only with fp16
  precision on).

The whole model's step is the same with token ids in and one cache pair per layer:

```
lm_npu_step(input_ids [B,T] int32, position_ids [B,T] int32, attention_mask [B,1,T,C+T],
            past_key.i, past_value.i [B,Hkv,C,D] for each layer i) -> logits [B,1,V], key.i, value.i [B,Hkv,T,D]
```

`logits` are the step's last position's: feed a prompt so that its last token is the last row of a step (a
partial chunk first, its end padded and overwritten by the next chunk; a prompt shorter than T as a padded
chunk of all but its last token, then a decode step for the last), then one decode step per new token.

## Compiled for Snapdragon NPUs (QNN HTP)

{compiled}

| soc_model | chip | deploy |
|---|---|---|
{deploy}

## Verified on (measured when this bundle was built)

{accepted}
"""


def main(argv=None) -> int:
    p = Parser(prog="python -m export.handoff", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="minimind", help="model config [minimind]")
    p.add_argument("--out", help="bundle folder [artifacts/PRESET/handoff]")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="models to include [all]")
    p.add_argument("--socs", nargs="*", type=int, default=list(qnn.SOCS), metavar="SOC",
                   help=f"QNN soc_model numbers to compile the npu graphs for (none: skip) [{' '.join(map(str, qnn.SOCS))}]")
    p.add_argument("--windows", default="auto", metavar="SIZES",
                   help="the window ladder, as for python -m export (each window needs room for a prefill chunk and "
                        f"{DECODE_STEPS} decode steps) [auto]")
    return run(_build, p.parse_args(argv))


def _build(args) -> int:
    config = preset(args.preset)
    build(config, args.out or f"artifacts/{args.preset}/handoff", kinds=tuple(args.kinds), socs=args.socs,
          windows=ladders.parse(args.windows, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
