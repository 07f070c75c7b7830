"""Quantized targets: what each `--quant` scheme is, and the QDQ graphs NPU toolchains compile.

- `int4`, `int8` (target `ort-int4`, `ort-int8`): the ort graph with its linear layers' weights
  as MatMulNBits blocks of 32 (passes/quantize_blocks.py; int4: a scale and a minimum per block,
  the lm_head int8; int8: symmetric), activations fp32. A step whose quantized form measured slower
  than fp32 on this CPU keeps the fp32 graph: prefill, compute-bound, where MatMulNBits without VNNI
  runs below fp32 GEMM (make bench: int4 prefill@128 121 ms vs fp32 111, int8 1.4x slower in
  docs/quantization.md). Decode, bound by bytes, is where the bits pay.
- `w8a16` (target `npu-w8a16`): the npu graph in QDQ form for NPU compilers (QNN HTP, OpenVINO):
  weights int8 symmetric (per output channel), activations uint16 with ranges calibrated on
  activations recorded from real forward passes, by onnxruntime's static quantizer (MinMax). The
  graph moves to opset 21, where 16-bit QuantizeLinear is standard ONNX.

Each scheme has a budget against fp32 eager PyTorch, set from measured errors with a margin (SCHEMES): every
single step (on caches eager filled from a real prefix) and every sequence is held to its max relative error; the
accuracy prompt set (runtime/accuracy.py, 68 next-token distributions) to all of it, KL and top-1 too. A step or
a sequence gives one to 17 rows, where one near-tie flips top-1 (random weights: every logit is a near-tie), so
the distribution measures are held where they are a statistic. The export refuses a graph past its budget.
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

import registry
from models import AttentionConfig
from runtime.drivers import HostCacheGenerator
from runtime.metrics import Budget

from passes.build import replace_value
from passes.lint import WEIGHTED
from passes.mixed_precision import BOUNDED_OPS, FLOAT_OPS, METADATA, WIDE_RANGE, reasons
from passes.quantize_weights import constant_weights, ort_quantization, quiet


SCHEMES = {name: t.scheme for name, t in registry.schemes().items()}  # the registry's schemes, by name
CALIBRATION_PROMPTS = 12
FIRST_TOKEN_PROMPTS = 4
CALIBRATION_DECODE_STEPS = 8
# A trained model's calibration also reads text, through its folder's tokenizer (text_inputs): random tokens never show
# it a chat template's tokens, where its attention sinks and largest activations are. SmolLM2-135M's w8a16 on the
# benchmark's real prompts (benchmarks/prompts.json, none of these): KL 0.47 calibrated on random tokens alone, 0.012
# with these six prompts first; greedy tokens equal to fp32's 13 -> 22 of 64.
CALIBRATION_CHATS = ("List four animals that live in the Arctic.", "Describe how a bicycle gear works.",
                     "Write a short thank-you note to a teacher.", "What is photosynthesis?")
CALIBRATION_TEXT = ("The history of the printing press begins in the fifteenth century, when",
                    "def parse_args(argv):\n    parser = ")
# Activation ranges are the calibrated min..max widened by half its width each side (one bit of sixteen): a decode step
# sees one token, so the decode graph's ranges come from a few dozen tokens, and a token outside them is clipped
# (SmolLM2-135M's decode step over 2047 rows of random tokens, calibrated exactly: 198 of 2295 tensors past their
# range, by up to 24% of its width; max_rel 0.53). Softmax and Sigmoid outputs keep their range: it is exact.
RANGE_MARGIN = 0.5


class QuantError(ValueError):
    """A quantization scheme that does not apply here."""


def parse(quant: str | None) -> tuple[str, ...]:
    """'int4,w8a16' -> ('int4', 'w8a16'); 'none' or empty -> ()."""
    names = tuple(dict.fromkeys(q.strip() for q in (quant or "").split(",") if q.strip() and q.strip() != "none"))
    unknown = [n for n in names if n not in registry.schemes()]
    if unknown:
        raise QuantError(f"--quant: unknown scheme(s) {unknown}; expected a comma-separated list of "
                         f"{', '.join(registry.schemes())} or none")
    return names


def target(scheme: str) -> str:
    """The target a scheme makes: int4 -> ort-int4."""
    return registry.quantized_by(scheme).name


def budget(target: str, float_tolerance: float, grid: dict | None = None) -> Budget:
    """What a graph of `target` is held to against eager fp32: the registry's GRID_RULE given what its scheme's grid
    costs the model (`grid`, export/grid_cost.py; None: the rule's cap), or the float tolerance."""
    scheme = registry.target(target).scheme
    return registry.GRID_RULE.budget(grid) if scheme else Budget(float_tolerance)


def channel_rounded(w: np.ndarray) -> np.ndarray:
    """W [K, N] on w8a16's weight grid: int8 symmetric per output channel, |q| <= 127 (onnxruntime's quantizer with
    WeightSymmetric, per_channel over MatMul's axis 1)."""
    scale = np.abs(w).max(axis=0, keepdims=True).astype(np.float64) / 127
    q = np.clip(np.round(w / np.where(scale == 0, 1, scale)), -127, 127)
    return (q * scale).astype(w.dtype)


def step_budget(budget: Budget) -> Budget:
    """What a single step or a sequence is held to: `budget` without its distribution measures (module docstring)."""
    return Budget(budget.max_rel)


def spell(budget: Budget) -> str:
    """'max_rel <= 0.6, kl_mean <= 0.1, top-1 >= 25%': a budget as error messages state it."""
    parts = [f"max_rel <= {budget.max_rel:g}"]
    parts += [f"kl_mean <= {budget.kl_mean:g}"] if budget.kl_mean is not None else []
    parts += [f"top-1 >= {budget.top1:.0%}"] if budget.top1 is not None else []
    parts += ["eager's argmax on every row it decides"] if budget.decided else []
    return ", ".join(parts)


def tolerance(target: str, float_tolerance: float, grid: dict | None = None) -> float:
    """The normwise part of budget(): the max relative error, as manifests record it."""
    return budget(target, float_tolerance, grid).max_rel


def grid_of(manifest: dict, target: str) -> dict | None:
    """What the target's scheme's grid cost the model, as its export measured it (None: not measured there)."""
    return manifest.get("lm", {}).get("quantization", {}).get(target, {}).get("grid")


def describe(scheme: str) -> dict:
    t = registry.quantized_by(scheme)
    s = t.scheme
    rule = registry.GRID_RULE
    return {"scheme": scheme, "base": t.parent, "what": s.what, "quantized_steps": list(s.quantized_steps),
            "budget_rule": {"headroom": rule.k, "floor": asdict(rule.floor), "cap": asdict(rule.cap)}}


def calibration_inputs(config: AttentionConfig, kind: str, seed: int = 4321, text: Path | None = None) -> list[np.ndarray]:
    """Prompts the calibration runs: token ids for the whole model, hidden states [B, L, E] otherwise; for a whole model
    whose folder `text` holds a tokenizer, text_inputs() first. Then the random ones: the first
    FIRST_TOKEN_PROMPTS are a single token: a decode step at p0 = 0 attends over an empty cache, where one row's softmax
    weight is 1, and a trained model's first token carries activations no later one does (SmolLM2-135M's decode step
    at p0 = 0 measured max_rel 0.40 calibrated on one such prompt, 0.09 on four; minimind's 2.28 on none). The last
    fills the cache, so the steps over all of it are calibrated (SmolLM2-135M's decode step over 2047 rows measured
    0.535 when no prompt passed 392 tokens). The others' lengths spread from half a chunk to three chunks. A different
    seed from the accuracy prompts, so accuracy is measured on inputs the ranges never saw."""
    rng = np.random.default_rng(seed)
    longest = config.capacity - CALIBRATION_DECODE_STEPS
    spread = rng.integers(config.chunk // 2, 3 * config.chunk, CALIBRATION_PROMPTS - FIRST_TOKEN_PROMPTS - 1)
    lengths = [1] * FIRST_TOKEN_PROMPTS + [min(longest, int(n)) for n in spread] + [longest]
    if kind == "lm":
        return (text_inputs(text, config) if text is not None else []) + \
            [rng.integers(0, config.vocab_size, (config.batch, n + CALIBRATION_DECODE_STEPS)) for n in lengths]
    return [rng.standard_normal((config.batch, n + CALIBRATION_DECODE_STEPS, config.hidden_size)).astype(np.float32)
            for n in lengths]


def text_inputs(folder: Path, config: AttentionConfig) -> list[np.ndarray]:
    """CALIBRATION_CHATS through the folder's chat template (as plain text where it has none), then CALIBRATION_TEXT,
    as token ids [B, L + CALIBRATION_DECODE_STEPS] (the model decodes its own tokens there)."""
    from runtime.text import chat_ids, load_tokenizer, prompt_ids
    tokenizer = load_tokenizer(folder)
    chat = bool(getattr(tokenizer, "chat_template", None))
    ids = [chat_ids(tokenizer, t, str(folder)) if chat else prompt_ids(tokenizer, t) for t in CALIBRATION_CHATS]
    ids += [prompt_ids(tokenizer, t) for t in CALIBRATION_TEXT]
    if (top := max(max(i) for i in ids)) >= config.vocab_size:
        raise QuantError(f"the tokenizer of {folder} gives token id {top}; expected ids below the model's vocab_size "
                         f"{config.vocab_size}")
    return [np.array([i + [0] * CALIBRATION_DECODE_STEPS] * config.batch) for i in ids]


def step_feeds(driver: HostCacheGenerator, inputs: list[np.ndarray], kind: str, step: str) -> Iterator[dict]:
    """Every feed the `step` graph of `driver` sees while it reads each input: all but its last
    CALIBRATION_DECODE_STEPS positions as a prompt, then that many decode steps. Yielded as they are made, so memory
    holds a step's caches or two, not every step's (Qwen3-0.6B's caches at C=2048 are 470 MB a feed, and a cache-filling
    prompt makes 16 of them). The whole model decodes its own greedy tokens, as generation does: a trained model's
    continuation of a prompt reaches activations random tokens do not (SmolLM2-135M's w8a16, calibrated on random
    decode tokens: max_rel 1.18 and KL 0.84 on the accuracy prompts, which decode the reference's greedy continuation;
    on its own greedy tokens 0.22 and 0.039). Other kinds decode the input's positions."""
    session = driver.prefill_session if step == "prefill" else driver.decode_session
    made, infer = [], driver.infer

    def recorded(s, feeds: dict) -> dict:
        if s is session:
            made.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return infer(s, feeds)
    driver.infer = recorded
    try:
        for _ in _runs(driver, inputs, kind):
            yield from made
            made.clear()
    finally:
        del driver.infer


def _runs(driver: HostCacheGenerator, inputs: list[np.ndarray], kind: str) -> Iterator[None]:
    """Reads the inputs as step_feeds says, pausing after every call that runs a graph or two: a prompt goes in as a
    remainder, then whole chunks, one prefill run each (as `feed` reads it whole)."""
    for x in inputs:
        driver.reset()
        prompt = x[:, :-CALIBRATION_DECODE_STEPS]
        n = prompt.shape[1]
        cuts = [0, *range(n % driver.chunk or driver.chunk, n + 1, driver.chunk)]
        for a, b in zip(cuts, cuts[1:]):
            out = driver.feed(prompt[:, a:b])
            yield
        for i in range(n, x.shape[1]):
            out = driver.decode(np.argmax(out[:, -1:], axis=-1) if kind == "lm" else x[:, i:i + 1])
            yield


def qdq(model: ir.Model, feeds: Iterable[dict], opset: int) -> tuple[ir.Model, int, dict[str, dict]]:
    """The float npu graph `model` in QDQ form (w8a16), activation ranges from `feeds` (widened); how many feeds it
    read; and the activations it left float, each with its reason (passes/mixed_precision.py)."""
    q = ort_quantization()
    constant_weights(model)  # so the tied lm_head is quantized as a weight (per channel), not as an activation
    readers = _wide_constant_readers(model)
    proto = onnx.version_converter.convert_version(ir.serde.serialize_model(model), opset)
    with tempfile.TemporaryDirectory(prefix="qdq-") as tmp, quiet():
        src, dst, cache = f"{tmp}/float.onnx", f"{tmp}/qdq.onnx", f"{tmp}/ranges.json"
        onnx.save(proto, src, save_as_external_data=True, location="float.data")
        ops = sorted({n.op_type for n in proto.graph.node})  # all of them: its default list leaves e.g. Sqrt in float
        ranges, read = _ranges(q, src, ops, feeds, tmp)
        bounded = {o for n in proto.graph.node if n.op_type in BOUNDED_OPS for o in n.output}
        why = reasons(model, {name: d.range_value for name, d in ranges.data.items()})
        q.calibrate.save_tensors_data(q.TensorsData(q.CalibrationMethod.MinMax, {
            name: d.range_value if name in bounded else _widened(*d.range_value) for name, d in ranges.data.items()}),
            cache)
        q.quantize_static(src, dst, None, quant_format=q.QuantFormat.QDQ, per_channel=True, op_types_to_quantize=ops,
                          activation_type=q.QuantType.QUInt16, weight_type=q.QuantType.QInt8,
                          calibration_cache_path=cache, nodes_to_exclude=readers + _float_weight_readers(model, why),
                          extra_options={"QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}, "WeightSymmetric": True,
                                         "ActivationSymmetric": False})
        quantized = ir.serde.deserialize_model(onnx.load(dst))
        kept = {name: why[name] for name in _keep_float(quantized, list(why))}
        if kept:  # declared with their reasons, so that lint tells them from a float island and re-checks each
            quantized.metadata_props[METADATA] = json.dumps(kept)
        return quantized, read, kept


def _wide_constant_readers(model: ir.Model) -> list[str]:
    """The nodes reading a float constant that passes +-WIDE_RANGE other than as a matmul weight (an embedding table
    with massive entries): the quantizer would give it one 16-bit grid, as an activation, so those nodes stay float."""
    def wide(v: ir.Value | None) -> bool:
        t = v.const_value if v is not None else None
        if t is None or v.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return False
        a = t.numpy()
        return a.size > 0 and max(float(a.max()), -float(a.min())) > WIDE_RANGE
    return [n.name for n in model.graph
            if any(wide(v) for i, v in enumerate(n.inputs) if WEIGHTED.get(n.op_type) != i)]


def _float_weight_readers(model: ir.Model, wide: list[str]) -> list[str]:
    """The matmuls that read or write an activation kept float: their weights stay float too (fp16 on the HTP). QNN's
    HTP runs a per-channel weight's DequantizeLinear only inside its matmul's quantized group, which a float activation
    breaks: "QNN EP does not support a standalone DQ op with per-channel quantization" (SmolLM2-135M: the MLP down
    projections that write or read its massive activations, 5 of 210 matmuls)."""
    wide = set(wide)
    return [n.name for n in model.graph if n.op_type in WEIGHTED and len(n.inputs) > WEIGHTED[n.op_type]
            and n.inputs[WEIGHTED[n.op_type]] is not None and n.inputs[WEIGHTED[n.op_type]].const_value is not None
            and any(v is not None and v.name in wide for v in (*n.inputs, *n.outputs))]


def _keep_float(model: ir.Model, names: list[str]) -> list[str]:
    """Remove the QuantizeLinear -> DequantizeLinear pairs the quantizer put on the activations `names`, so that their
    consumers read them float; those that had one, in the order of `names`."""
    wanted, kept = set(names), set()
    for q in [n for n in model.graph if n.op_type == "QuantizeLinear" and n.inputs[0].name in wanted]:
        name = q.inputs[0].name  # before replace_value, which renames it where the pair ended at a graph output
        for dq in [u.node for u in q.outputs[0].uses() if u.node.op_type == "DequantizeLinear"]:
            replace_value(dq.outputs[0], q.inputs[0])
            model.graph.remove(dq, safe=True)
            kept.add(name)
        if not q.outputs[0].uses():
            model.graph.remove(q, safe=True)
    return [name for name in names if name in kept]


def _ranges(q, src: str, ops: list[str], feeds: Iterable[dict], tmp: str):
    """Each tensor's (min, max) over `feeds` (onnxruntime's MinMax calibrator), and how many feeds it read."""
    calibrator = q.create_calibrator(Path(src), ops, augmented_model_path=f"{tmp}/augmented.onnx",
                                     calibrate_method=q.CalibrationMethod.MinMax, use_external_data_format=True)
    it, read = iter(feeds), 0

    class Reader(q.CalibrationDataReader):
        def get_next(self):
            nonlocal read
            feed = next(it, None)
            read += feed is not None
            return feed
    calibrator.collect_data(Reader())
    return calibrator.compute_data(), read


def _widened(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A calibrated range with RANGE_MARGIN of its width added each side: a 16-bit step doubles, and a value the
    calibration did not reach is not clipped."""
    margin = (high - low) * RANGE_MARGIN
    return (low - margin).astype(low.dtype), (high + margin).astype(high.dtype)
