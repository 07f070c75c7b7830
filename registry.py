"""Every target and quantization scheme, defined once: what each is made of and what it is held to.

A target is the graph form one toolchain takes: `raw` (torch.export's graph, cleaned), `onnx` (standard opset-24
Attention), `ort` (onnxruntime's contrib ops), `npu` (opset-17 static primitives with a host-owned cache and mask).
A quantized target is its base target's graph with a scheme applied: weight-only blocks in the pass pipeline
(`ort-int4`, `ort-int8`), or QDQ calibrated on the exported float graphs (`npu-w8a16`). The CLI choices, the pass
pipelines, the export, the manifest, the hand-off, the verifier and the benchmarks read this table: adding a target
is one entry here and its own pass files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.metrics import Budget, GridRule

STEPS = ("prefill", "decode")  # the step graphs each target has: a prompt's chunk, one token
GRAPH, HOST = "graph", "host"  # who owns the KV cache: the graph (present_* out) or the host (new rows out, mask in)


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme: its own name (`--quant NAME`), where it applies and what it is held to."""
    name: str
    quantizer: str                  # "blocks": a pass of the pipeline; "qdq": calibrated on the exported float graphs
    quantized_steps: tuple          # steps that get the quantized graph (the others keep the base graph's)
    grid: Callable                  # (W [K, N], is the lm_head) -> W on the scheme's grid (export/grid_cost.py)
    activations: str | None         # "int8-blocks": each product's input per block of 32 (MatMulNBits level 4);
                                    # "uint16-tensor": every activation per tensor (QDQ); None: float
    what: str
    weight_bits: float = 32         # bits read per weight, scales included, the fewest any layer reads (a floor)


@dataclass(frozen=True)
class Target:
    name: str
    parent: str | None              # the target whose passes run first
    passes: Callable[[dict], list]  # its own passes after the parent's, given the --fix-dims pins
    what: str
    cache: str = GRAPH
    opset: int | None = None        # the opset its graphs are written in (None: the exporter's)
    lint: str | None = None         # the passes/lint.py profile its graphs are held to
    contrib: bool = False           # onnxruntime contrib ops, outside ONNX's schemas (onnx.checker cannot check them)
    in_place: bool = False          # its cache write runs in place in onnxruntime when past and present share a buffer
    mask_value: float | None = None  # a host-cache target's masked-score value
    scheme: Scheme | None = None
    bundled: tuple = ()             # (kind, dtype) pairs the hand-off bundle carries it for
    fuses: bool = True              # its passes fuse each attention (raw keeps torch.export's ops)


def _fused(contrib: bool) -> list:
    from passes.cleanup import Cleanup
    from passes.einsum_to_matmul import EinsumToMatMul
    from passes.fuse_attention import FuseAttention
    from passes.fuse_cache_write import FuseCacheWrite
    from passes.fuse_rmsnorm import FuseRMSNorm
    from passes.fuse_rope import FuseRoPE
    from passes.upgrade_opset import UpgradeOpset
    return [UpgradeOpset(STANDARD_OPSET), EinsumToMatMul(), FuseRMSNorm(contrib), FuseRoPE(contrib), FuseAttention(),
            FuseCacheWrite(), Cleanup()]


def _raw(fix_dims: dict) -> list:
    from passes.cleanup import Cleanup
    from passes.fix_dims import FixDims
    return [FixDims(fix_dims), Cleanup()]


def _ort(fix_dims: dict) -> list:
    from passes.cleanup import Cleanup
    from passes.fold_rope_gqa import FoldRoPEIntoGQA
    from passes.lower_gqa import LowerToGQA
    from passes.pack_matmuls import PackMatMuls
    from passes.pack_qkv import PackQKV
    return _fused(True) + [LowerToGQA(), Cleanup(), FoldRoPEIntoGQA(), PackMatMuls(), PackQKV(), Cleanup()]


def _npu(fix_dims: dict) -> list:
    from passes.cleanup import Cleanup
    from passes.lower_npu import LowerNPU
    return [LowerNPU(), Cleanup()]


def _block_grid(bits: int) -> Callable:
    def grid(w, head: bool):
        from passes.quantize_blocks import HEAD_BITS, rounded
        return rounded(w, HEAD_BITS if head and bits == 4 else bits)
    return grid


def _channel_grid(w, head: bool):
    from export.quantize import channel_rounded
    return channel_rounded(w)


def _blocks(bits: int) -> Callable[[dict], list]:
    def passes(fix_dims: dict) -> list:
        from passes.quantize_blocks import QuantizeBlocks
        return [QuantizeBlocks(bits, accuracy_level=4)]  # int8 compute: level 0 made int4 3x, int8 30x slower
    return passes


STANDARD_OPSET = 24
NPU_OPSET = 17
NPU_MASK_VALUE = -30000.0  # finite in fp16
# QDQ graphs: 16-bit scores after the mask would otherwise step by 0.5; exp(-100) is as good as zero beside any
# visible score.
QDQ_MASK_VALUE = -100.0
# Every scheme's budget on a model follows one rule (runtime/metrics.GridRule): GRID_HEADROOM times what the scheme's
# grid alone costs that model in eager PyTorch (export/grid_cost.py: the weights rounded onto the grid, the activations
# too where the kernel rounds them, on the same prompts), as fp16 is held to FP16_HEADROOM times what fp16 costs the
# model. The reference leaves out what the graph adds besides the grid (its kernels' order of sums; w8a16's 16-bit
# activations); the headroom is for that. The floor: a budget finer than fp16's tolerance (1e-2), than 1e-4 nats, or
# than a few rows of near-ties (5% of top-1) would hold a graph to its kernels' rounding, not to its grid. The cap: an
# all-zero output is max_rel 1, so 0.75 still refuses one; half a nat of KL and 25% top-1 are a model no longer
# itself. No figure of a model these gate set any of them.
GRID_HEADROOM = 3.0
GRID_RULE = GridRule(GRID_HEADROOM, floor=Budget(1e-2, kl_mean=1e-4, top1=0.95), cap=Budget(0.75, kl_mean=0.5, top1=0.25))
# w8a16's weights stay per output channel: blocks of 32 along K held SmolLM2's weights better off the HTP (its w8a16
# export's KL 5.2e-3 -> 1.15e-3, commit ce13e43, reverted), but QNN's HTP dequantizes blocks and multiplies in fp16,
# where per-channel weights multiply 16-bit activations in integers: the blocked hand-off's prefill golden over 2048
# rows measured max_rel 0.567 on SoC 43 (per channel 0.31), past the budget.
_PREFILL = "activations fp32; prefill keeps fp32 weights (measured faster)"
_ENTRIES = (
    Target("raw", None, _raw, "torch.export's graph, cleaned up", fuses=False),
    Target("onnx", "raw", lambda fix_dims: _fused(False),
           "standard opset-24 Attention, TensorScatter, RMSNormalization",
           opset=STANDARD_OPSET, lint="standard", in_place=True, bundled=(("attention", "fp32"), ("block", "fp32"))),
    Target("ort", "raw", _ort, "onnxruntime GroupQueryAttention, SimplifiedLayerNormalization", lint="contrib",
           contrib=True, in_place=True),
    Target("npu", "onnx", _npu, "opset-17 static primitives, host-owned cache and mask", cache=HOST, opset=NPU_OPSET,
           lint="static", mask_value=NPU_MASK_VALUE,
           bundled=tuple((k, d) for k in ("attention", "block", "lm") for d in ("fp32", "fp16"))),
    Target("ort-int4", "ort", _blocks(4), "ort with its linear layers' weights int4", lint="contrib", contrib=True,
           in_place=True, scheme=Scheme(
               "int4", "blocks", ("decode",), _block_grid(4), "int8-blocks",
               "weights int4 in blocks of 32 with a scale and a minimum each (llama.cpp's Q4_1 grid; MatMulNBits plus "
               "each block's input sum times its minimum), the lm_head int8 symmetric in blocks of 32 (Q8_0), "
               f"accuracy level 4; {_PREFILL}", weight_bits=6)),  # a scale and a minimum per 32 (lm_head: 9)
    Target("ort-int8", "ort", _blocks(8), "ort with its linear layers' weights int8", lint="contrib", contrib=True,
           in_place=True, scheme=Scheme(
               "int8", "blocks", ("decode",), _block_grid(8), "int8-blocks",
               "weights int8 symmetric in blocks of 32 (llama.cpp's Q8_0 grid; MatMulNBits, accuracy level 4); "
               + _PREFILL, weight_bits=9)),  # one fp32 scale per 32
    Target("npu-w8a16", "npu", lambda fix_dims: [], "npu in QDQ form (opset 21), weights int8, activations uint16",
           cache=HOST, opset=21, lint="static-qdq", mask_value=QDQ_MASK_VALUE, bundled=(("lm", "fp32"),),
           scheme=Scheme(
               "w8a16", "qdq", ("prefill", "decode"), _channel_grid, "uint16-tensor",
               "QDQ: weights int8 symmetric per output channel, activations uint16 asymmetric per tensor, "
               "MinMax-calibrated; an activation whose range is too wide for 16 bits stays float, and so do attention "
               "probabilities and norms' means of squares (mixed precision)", weight_bits=8)),
)
TARGETS: dict[str, Target] = {t.name: t for t in _ENTRIES}
RUN_BY_DEFAULT = "ort"  # what runtime.generate and the benchmarks run unless told: onnxruntime's fastest graphs


def target(name: str) -> Target:
    """The registry's entry for `name`; a clear error naming the known ones otherwise."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}: expected one of {', '.join(TARGETS)}")
    return TARGETS[name]


def root() -> str:
    """The target every pipeline starts from: torch.export's graph, cleaned up."""
    return next(n for n, t in TARGETS.items() if t.parent is None)


def float_targets() -> tuple[str, ...]:
    """The targets no scheme quantizes: what `--target` exports by default."""
    return tuple(n for n, t in TARGETS.items() if t.scheme is None)


def pipeline_targets() -> tuple[str, ...]:
    """The targets `python -m passes` makes from one graph: the float ones, and those whose scheme is a pass."""
    return tuple(n for n, t in TARGETS.items() if t.scheme is None or t.scheme.quantizer == "blocks")


def schemes() -> dict[str, Target]:
    """{scheme name: its target}: what `--quant` accepts."""
    return {t.scheme.name: t for t in TARGETS.values() if t.scheme is not None}


def base(name: str) -> str:
    """The float target a target's graphs come from: itself, or a quantized target's nearest unquantized ancestor."""
    t = target(name)
    return name if t.scheme is None else base(t.parent)


def lineage(name: str) -> list[str]:
    """The targets whose passes make `name`'s, first to last: ort-int4 -> [raw, ort, ort-int4]."""
    t = target(name)
    return (lineage(t.parent) if t.parent else []) + [name]


def quantized_by(scheme_name: str) -> Target:
    if scheme_name not in schemes():
        raise ValueError(f"unknown scheme {scheme_name!r}: expected one of {', '.join(schemes())}")
    return schemes()[scheme_name]
