"""How close an output is to its reference: the one rule every gate uses.

How close an output is to its reference: the one rule every gate uses (export parity, quantized accuracy,
passes --verify, the bundle verifier, the fuzzer).

The rule is normwise relative: max |a - e| / max |e| within a budget, every value finite where the reference
is. A broken output cannot pass it at any budget we use, since every budget is below 1:

- all zeros: exactly 1;  NaN or inf: refused outright (`finite`);
- shuffled, noise of the output's scale, or a constant against zero-centred outputs (hidden states,
  logits, K/V rows): about 1 or more.

Logits get a distribution measure beside it (`logit_error`): KL(reference || output) of the softmax and
top-1 agreement, which a `Budget` can bound too (a constant output's uniform distribution is far in KL
from a trained model's; random weights are near-uniform themselves, so there the normwise rule carries it).

No torch here, so a hand-off bundle's verifier can use it with numpy and onnxruntime alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The one table of float tolerances (max_rel against eager fp32): a dtype's rounding leaves this much and no more on
# the tiny models' steps. fp64 graphs appear only as inputs the passes rewrite (passes/verify.py).
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "fp64": 1e-9}
NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "fp64": np.float64}


def numpy_tolerance(dtype) -> float:
    """TOLERANCE of a numpy dtype; 0 (exact) for one the table has not (integers)."""
    return next((t for d, t in TOLERANCE.items() if np.dtype(NUMPY_DTYPES[d]) == np.dtype(dtype)), 0.0)

# A deep trained model drifts from fp32 in fp16 by itself: SmolLM2-135M in eager PyTorch fp16 against fp32, max_rel
# 1.0e-2 over 2048 rows, 0.14 at a prefill chunk at row 192 of a 512-row cache (its massive activations on fp16's grid).
# No fp16 computation of such a model can be held to 1e-2 there, so fp16 is held to FP16_HEADROOM times the model's own
# eager fp16 error on the same inputs where that passes 1e-2 (fp16_tolerance). Never past FP16_CAP: a budget that
# followed a model drifting further would pass a graph computing nothing right.
FP16_HEADROOM, FP16_CAP = 3.0, 0.05
# Each output (the logits or hidden states, each cache) follows its own eager fp16 error: a cache eager fp16 reproduces
# 50x more closely than the logits is not held to the logits' budget. A float graph's logits are also held to eager's
# argmax on every row it decides: where eager fp32's top-2 margin exceeds DECIDED_MARGIN times eager fp16's largest
# error on that row (two logits each off by that error swap only under a margin of 2x; 3x leaves headroom).
DECIDED_MARGIN = 3.0


@dataclass(frozen=True)
class Budget:
    """What an output may be off by: max_rel always; for logits also a KL bound (mean over steps, nats), the least
    top-1 agreement, and (`decided`) no swapped argmax on a row eager decides. A float tolerance is
    Budget(max_rel=tolerance)."""
    max_rel: float
    kl_mean: float | None = None
    top1: float | None = None
    decided: bool = False  # logits: the argmax agrees on every row eager decides (decided_rows; the error's `swapped`)

    def __post_init__(self):
        if not 0 <= self.max_rel < 1:
            raise ValueError(f"budget max_rel={self.max_rel}; expected 0 <= max_rel < 1 (an all-zero output has "
                             "max_rel exactly 1, so a budget of 1 or more passes it)")


@dataclass(frozen=True)
class GridRule:
    """A quantization scheme's budget on a model: `k` times what the scheme's grid alone costs that model (its `grid`
    figures: eager PyTorch with the weights, and the activations where the kernel rounds them, on the grid, everything
    else fp32, against fp32 eager on the same prompts; export/grid_cost.py), each measure within [floor, cap]. The
    floor is where the grid costs a model next to nothing; the cap is where a graph computing nothing right would
    pass. Fed by the eager model alone: a graph's own error never moves its budget."""
    k: float
    floor: Budget
    cap: Budget

    def budget(self, grid: dict | None) -> Budget:
        """The budget given the grid's figures (max_rel, kl_mean, top1); the cap where there are none (a graph
        without its eager model, an export of one layer)."""
        if grid is None:
            return self.cap
        within = lambda x, lo, hi: float(min(max(self.k * x, lo), hi))  # noqa: E731
        miss = within(1 - grid["top1"], 1 - self.floor.top1, 1 - self.cap.top1)
        return Budget(within(grid["max_rel"], self.floor.max_rel, self.cap.max_rel),
                      kl_mean=within(grid["kl_mean"], self.floor.kl_mean, self.cap.kl_mean), top1=1 - miss)


def error(actual: np.ndarray, expected: np.ndarray) -> dict:
    """max |a - e|, the same relative to max |e| (normwise relative), and whether `actual` is finite wherever
    `expected` is (a NaN or inf the reference does not have)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != e.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "finite": False, "shape": [list(a.shape), list(e.shape)]}
    if e.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "finite": True}
    ok = np.isfinite(e)
    same = (a[~ok] == e[~ok]) | (np.isnan(a[~ok]) & np.isnan(e[~ok]))  # the reference's own NaN/inf, reproduced
    finite = bool(np.isfinite(a[ok]).all()) and bool(same.all())
    diff = float(np.abs(a[ok] - e[ok]).max()) if ok.any() else 0.0
    scale = float(np.abs(e[ok]).max()) if ok.any() else 0.0
    if not finite:
        diff = float("inf")
    return {"max_abs": diff, "max_rel": diff / scale if scale else diff, "finite": finite}


def logit_error(actual: np.ndarray, expected: np.ndarray) -> dict:
    """error() over logits [..., V], plus KL(expected || actual) of their softmax (mean and max over rows, nats)
    and top-1 agreement (the share of rows whose argmax is the reference's)."""
    err = error(actual, expected)
    if "shape" in err:
        return err | {"kl_mean": float("inf"), "kl_max": float("inf"), "top1": 0.0}
    rows = distribution(np.asarray(actual).reshape(-1, expected.shape[-1]),
                        np.asarray(expected).reshape(-1, expected.shape[-1]))
    kl = rows["kl"] if err["finite"] else np.full_like(rows["kl"], np.inf)
    return err | {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(rows["top1"].mean())}


def distribution(got: np.ndarray, ref: np.ndarray) -> dict:
    """Per row of [N, V]: max |got - ref| / max |ref| (`rel`), KL(ref || got) of the softmax (`kl`) and whether
    the argmax agrees (`top1`)."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
        logp, logq = _log_softmax(ref), _log_softmax(got)
        kl = (np.exp(logp) * (logp - logq)).sum(-1)
    kl = np.where(np.isfinite(kl), kl, np.inf)
    return {"rel": np.where(np.isfinite(rel), rel, np.inf), "kl": kl, "top1": got.argmax(-1) == ref.argmax(-1)}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def worst(errors: list[dict]) -> dict:
    """The worst of several errors: largest max_abs, max_rel and KL, least top-1, finite only if all are; the rows
    swapped, added up."""
    out = {k: max(e[k] for e in errors) for k in ("max_abs", "max_rel")}
    out["finite"] = all(e.get("finite", True) for e in errors)
    for k in ("kl_mean", "kl_max"):
        if any(k in e for e in errors):
            out[k] = max(e[k] for e in errors if k in e)
    if any("top1" in e for e in errors):
        out["top1"] = min(e["top1"] for e in errors if "top1" in e)
    if any("swapped" in e for e in errors):
        out["swapped"] = sum(e.get("swapped", 0) for e in errors)
    return out


def budget(tolerance: float | Budget) -> Budget:
    return tolerance if isinstance(tolerance, Budget) else Budget(max_rel=float(tolerance))


def fp16_tolerance(drift: float | None) -> float:
    """What an fp16 computation of a model is held to against fp32, given `drift`: the max_rel of the model itself in
    eager PyTorch fp16 on the same inputs (None: not measured)."""
    return max(TOLERANCE["fp16"], min(FP16_HEADROOM * (drift or 0.0), FP16_CAP))


def dtype_tolerance(dtype: str, drift: float | None = None) -> float:
    """What a graph computing in `dtype` is held to against eager fp32: fp32's fixed tolerance, fp16's following the
    model's own eager fp16 `drift` on the same inputs (fp16_tolerance)."""
    return fp16_tolerance(drift) if dtype == "fp16" else TOLERANCE[dtype]


def decided_rows(expected: np.ndarray, half: np.ndarray) -> np.ndarray:
    """Per row of logits [..., V]: whether eager fp32's (`expected`) top-2 margin exceeds DECIDED_MARGIN times eager
    fp16's (`half`) largest error on that row, so that any computation within fp16's error gives the same argmax."""
    e = np.asarray(expected, np.float64).reshape(-1, expected.shape[-1])
    h = np.asarray(half, np.float64).reshape(e.shape)
    top2 = np.sort(e, axis=-1)[:, -2:] if e.shape[-1] > 1 else np.concatenate([e, np.full_like(e, -np.inf)], -1)
    noise = np.abs(h - e).max(-1)
    return (top2[:, 1] - top2[:, 0]) > DECIDED_MARGIN * np.where(np.isfinite(noise), noise, np.inf)


def swapped(actual: np.ndarray, expected: np.ndarray, decided: np.ndarray) -> int:
    """How many rows of logits [..., V] that eager decides (decided_rows) have another argmax in `actual`."""
    a = np.asarray(actual).reshape(-1, expected.shape[-1])
    e = np.asarray(expected).reshape(-1, expected.shape[-1])
    return int((decided & (a.argmax(-1) != e.argmax(-1))).sum())


def per_output(errors: dict[str, dict], budgets: dict[str, Budget]) -> tuple[str, str] | None:
    """None if each output's error is within its own budget, else (the first output that missed, why)."""
    for name, err in errors.items():
        if why := why_not(err, budgets[name]):
            return name, why
    return None


def why_not(err: dict, tolerance: float | Budget) -> str | None:
    """None if `err` is within `tolerance`, else which measure missed, in a few words."""
    b = budget(tolerance)
    if "shape" in err:
        return f"shape {tuple(err['shape'][0])}; expected {tuple(err['shape'][1])}"
    if not err.get("finite", True) or not np.isfinite(err["max_rel"]):
        return "non-finite values (NaN or inf) where the reference is finite"
    if not err["max_rel"] <= b.max_rel:
        return f"max_rel {err['max_rel']:.3g} > {b.max_rel:g}"
    if b.kl_mean is not None and "kl_mean" in err and not err["kl_mean"] <= b.kl_mean:
        return f"kl_mean {err['kl_mean']:.3g} > {b.kl_mean:g}"
    if b.top1 is not None and "top1" in err and not err["top1"] >= b.top1:
        return f"top-1 agreement {err['top1']:.0%} < {b.top1:.0%}"
    if b.decided and err.get("swapped"):
        return (f"argmax differs on {err['swapped']} row(s) whose eager top-2 margin exceeds {DECIDED_MARGIN:g}x "
                "eager fp16's error there")
    return None


def close(err: dict, tolerance: float | Budget) -> bool:
    """Within the budget on every measure `err` carries; NaN never passes, and neither does an all-zero output."""
    return why_not(err, tolerance) is None
