"""Running rewritten graphs in onnxruntime: the run check every written graph passes, and --verify.

The run check: a graph is written only once it loads and runs on random feeds. --verify:
the graph before and after the passes, run on the same random feeds, outputs compared.

Feeds respect each input's shape and dtype (a symbolic dim gets a small sample value, the
same for every dim of that name); integer inputs get consecutive positions p0..p0+T-1 per row
(what every index-like input in a step graph expects), p0 mid-cache when there is a cache
(past_* [B, H, C, D]): a step at p0 = 0 reads no earlier row, and rotates by the identity,
so a dropped RoPE or a shifted mask would pass there. Outputs named present_* are
compared on the rows up to the last position written, since the step contract leaves later
rows unspecified (fused cache writes need not keep them). Each output is held to its dtype's
tolerance, or to a given budget (a quantized target's, export/quantize.py), by the one rule
of runtime/metrics.py; an output named `logits` also reports KL and top-1.
"""
from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort

from runtime.metrics import Budget, error, logit_error, numpy_tolerance, why_not

from .fix_dims import dim_value

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
          "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class VerifyError(ValueError):
    """The graph cannot be run to verify it."""


SAMPLE_DIM = 2


def _sample_shape(shape) -> list[int]:
    names = {n: SAMPLE_DIM for d in shape if isinstance(d, str) for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", d)}
    return [d if isinstance(d, int) else (dim_value(d, names) or SAMPLE_DIM) if isinstance(d, str) else 1 for d in shape]


def random_feeds(session: ort.InferenceSession, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    shapes = {arg.name: _sample_shape(arg.shape) for arg in session.get_inputs()}
    cache = min((s[2] for n, s in shapes.items() if n.startswith("past") and len(s) == 4), default=0)
    for arg in session.get_inputs():
        if arg.type not in _NUMPY:
            raise VerifyError(f"input {arg.name}: {arg.type}; expected a tensor input to make feeds for")
        dtype, shape = _NUMPY[arg.type], shapes[arg.name]
        if np.issubdtype(dtype, np.integer):
            t = shape[-1] if shape else 1
            feeds[arg.name] = np.broadcast_to(np.arange(t, dtype=dtype) + max(cache - t, 0) // 2, shape).copy()
        elif dtype == np.bool_:
            feeds[arg.name] = rng.random(shape) < 0.5
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _session(model_bytes_or_path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures surface as exceptions, not log lines
    try:
        return ort.InferenceSession(model_bytes_or_path, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise VerifyError(f"onnxruntime cannot load the graph: {str(e).strip().splitlines()[0][:200]}") from None


def run_check(after, before) -> str | None:
    """None if `after` (a path or serialized model) loads and runs on random feeds, else why not (and
    whether `before` runs on such feeds)."""
    try:
        session = _session(after)
        session.run(None, random_feeds(session))
        return None
    except Exception as e:
        why = _first_line(e)
    try:
        session = _session(before)
        session.run(None, random_feeds(session))
        return f"the rewritten graph does not run in onnxruntime ({why}), though its input does: a bug in the passes"
    except Exception as e:
        return f"the rewritten graph does not run in onnxruntime ({why}); its input does not run either ({_first_line(e)})"


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:240]


def compare(before, after, seed: int = 0, budget: Budget | None = None) -> dict:
    """Per output of `after` against `before` (paths or serialized models): its error, what it was held to
    (`budget`, else its dtype's tolerance), `ok`, and `why` not."""
    s0, s1 = _session(before), _session(after)
    feeds = random_feeds(s1, seed)  # the rewritten graph's shapes: its dims may have been pinned
    names = [o.name for o in s0.get_outputs()]
    try:
        ref, got = s0.run(names, feeds), s1.run(names, feeds)
    except Exception as e:
        raise VerifyError(f"running the graphs failed: {str(e).strip().splitlines()[0][:200]}") from None
    last = max((int(v.max()) for v in feeds.values() if np.issubdtype(v.dtype, np.integer) and v.size), default=None)
    results = {}
    for name, r, g in zip(names, ref, got):
        if name.startswith("present") and last is not None and r.ndim >= 3:
            r, g = r[:, :, : last + 1], g[:, :, : last + 1]
        held = budget or Budget(numpy_tolerance(r.dtype))
        err = (logit_error if name == "logits" else error)(g, r)  # NaN where `before` has it too is not the rewrite's
        why = why_not(err, held)
        results[name] = {**err, "tolerance": held.max_rel, "ok": why is None, "why": why}
    return results

