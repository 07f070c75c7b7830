"""What a quantization scheme's grid alone costs a model: the reference its budget follows (registry.GRID_RULE).

Eager PyTorch with every linear layer's weight rounded onto the scheme's grid as its graph stores it (the lm_head on
its own grid where the scheme gives it one), and the activations rounded as the scheme rounds them (each product's
input to int8 per block of 32 where MatMulNBits computes at accuracy level 4; every module's output to uint16 per
tensor for QDQ), everything else fp32: the whole model's next-token logits on the prompt set, teacher-forced on eager
fp32's own greedy tokens, against fp32's. A graph of the scheme is held to GRID_HEADROOM times these figures: they
measure the scheme on this model, not the graph. The reference rounds every product where a graph may keep some
float (int4's prefill, w8a16's excluded readers), so it is no finer than the graph.

The rounding happens in each layer's forward hooks, one layer's weight at a time, so the model is never held twice: a
0.6B model's layers rounded at every forward of the prompt set cost seconds, a rounded copy 2.4 GB.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from passes.mixed_precision import WIDE_RANGE
from runtime.metrics import distribution

BLOCK = 32  # the kernel's block of inputs (MatMulNBits' block_size)


def grid_figures(model: torch.nn.Module, scheme, prompts: list[np.ndarray], refs: list[tuple[np.ndarray, np.ndarray]],
                 vocab_size: int) -> dict:
    """The model on `scheme`'s grid (a registry.Scheme) against eager fp32's `refs` (runtime/accuracy.references) over
    `prompts`: max_rel, kl_mean and top1 of the next-token logits, as runtime/accuracy.measure reports a graph's; and
    how many layers and weights it rounded."""
    rows = []
    with on_grid(model, scheme, vocab_size) as rounded:
        for prompt, (tokens, ref) in zip(prompts, refs):
            ids = np.concatenate([prompt[:1], tokens[None, :len(ref) - 1]], axis=1)
            with torch.no_grad():
                logits = model.forward_full(torch.from_numpy(ids), keep=len(ref))
            rows.append(distribution(logits[0].float().numpy(), ref))
    rel, kl = np.concatenate([r["rel"] for r in rows]), np.concatenate([r["kl"] for r in rows])
    return {"max_rel": float(rel.max()), "kl_mean": float(kl.mean()),
            "top1": float(np.concatenate([r["top1"] for r in rows]).mean()), "layers": len(rounded),
            "weights": sum(layer.weight.numel() for layer in rounded)}


@contextmanager
def on_grid(model: torch.nn.Module, scheme, vocab_size: int):
    """Within: every nn.Linear whose input width is a multiple of BLOCK computes on the scheme's grid (the lm_head,
    the layer writing `vocab_size` outputs, on the head's). Yields those layers."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features % BLOCK == 0]
    hooks = []
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(_rounding(scheme, layer.out_features == vocab_size)))
        hooks.append(layer.register_forward_hook(_restoring))
    if scheme.activations == "uint16-tensor":  # QDQ rounds every activation, not only the products' inputs
        hooks += [m.register_forward_hook(_uint16_output) for m in model.modules()]
    try:
        yield layers
    finally:
        for h in hooks:
            h.remove()


def _rounding(scheme, head: bool):
    def hook(layer: torch.nn.Linear, args):
        w = layer.weight.data
        layer._fp32_weight = w  # restored after the forward: a tied lm_head's weight is the embedding's too
        on_grid = scheme.grid(w.float().numpy().T, head).T
        layer.weight.data = torch.from_numpy(np.ascontiguousarray(on_grid)).to(w.dtype)
        return (_int8_blocks(args[0]),) + args[1:] if scheme.activations == "int8-blocks" else None
    return hook


def _restoring(layer: torch.nn.Linear, args, output):
    layer.weight.data = layer.__dict__.pop("_fp32_weight")


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded to int8 symmetric per block of BLOCK along K, as MatMulNBits' int8 compute quantizes it."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.clamp(torch.round(blocks / torch.where(scale == 0, 1, scale)), -127, 127)
    return (q * scale).reshape(x.shape)


def _uint16_output(module: torch.nn.Module, args, out):
    """A module's output rounded to uint16 over its own range, as a QDQ graph's activation is over its calibrated one
    (which spans at least this forward's: the reference's grid is no coarser than the graph's); left float past
    +-WIDE_RANGE, as the graph leaves it (passes/mixed_precision.py)."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
        return None
    low, high = torch.clamp(out.amin(), max=0), torch.clamp(out.amax(), min=0)  # zero on the grid, as onnxruntime's
    if max(-low, high) > WIDE_RANGE or high == low:
        return None
    scale = (high - low) / 65535
    return torch.round((out - low) / scale) * scale + low
