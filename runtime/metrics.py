"""How close an output is to its reference: the one measure every parity check uses.

No torch here, so a hand-off bundle's verifier can use it with numpy and onnxruntime alone.
"""
from __future__ import annotations

import numpy as np

TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}


def error(actual: np.ndarray, expected: np.ndarray) -> dict:
    """max |a - e|, and the same relative to max |e| (a normwise relative error)."""
    if expected.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0}
    diff = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max())
    scale = float(np.abs(expected.astype(np.float64)).max())
    return {"max_abs": diff, "max_rel": diff / scale if scale else diff}


def worst(errors: list[dict]) -> dict:
    return {k: max(e[k] for e in errors) for k in ("max_abs", "max_rel")}


def close(err: dict, tolerance: float) -> bool:
    """DESIGN.md: within tolerance in absolute or relative terms; NaN never passes."""
    return bool(err["max_abs"] <= tolerance or err["max_rel"] <= tolerance)
