"""Parity of onnxruntime against eager PyTorch, the only reference that counts.

The reference is the eager model in fp32 (an fp16 model's weights upcast), so an fp16
graph is measured against the truth, not against another fp16 computation.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from models import AttentionConfig
from models.contract import INPUTS, example_inputs

from .generate import Driver, HostCacheGenerator
from .metrics import TOLERANCE, close, error, worst
from .session import StepSession

def within(err: dict, dtype: str) -> bool:
    return close(err, TOLERANCE[dtype])


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).float().eval()


def step_parity(model, runner: StepSession | HostCacheGenerator, config: AttentionConfig, seq_len: int, p0: int,
                seed: int = 0) -> dict:
    """One step at positions p0..p0+T-1 over a random cache; output and the written cache rows.

    `runner` is a step-contract session, or the host-cache driver of an `npu` graph (its
    cache set to the same random rows). Rows after the last written one are unspecified by
    the contract, so they are not compared.
    """
    args = example_inputs(config, seq_len, p0, seed)
    if isinstance(runner, HostCacheGenerator):
        runner.keys[...], runner.values[...] = args[2].numpy(), args[3].numpy()
        out = runner.run_step("prefill" if seq_len == config.chunk else "decode", args[0].numpy(), p0)
        got = {"output": out, "present_key": runner.keys, "present_value": runner.values}
    else:
        got = runner.run({name: a.numpy() for name, a in zip(INPUTS, args)})
    with torch.no_grad():
        ref = reference_model(model)(*[a.float() if a.is_floating_point() else a for a in args])
    live = p0 + seq_len
    errs = {"output": error(got["output"], ref[0].numpy()),
            "present_key": error(got["present_key"][:, :, :live], ref[1][:, :, :live].numpy()),
            "present_value": error(got["present_value"][:, :, :live], ref[2][:, :, :live].numpy())}
    return {"p0": p0, **worst(list(errs.values())), "per_output": errs}


def sequence_parity(model, generator: Driver, config: AttentionConfig, prompt_len: int, decode_steps: int,
                    seed: int = 0) -> dict:
    """Chunked prefill of a prompt, then decode steps, against the eager full-sequence forward (no cache)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(config.batch, prompt_len + decode_steps, config.hidden_size, generator=gen).to(config.torch_dtype)
    with torch.no_grad():
        ref = reference_model(model).forward_full(x.float()).numpy()
    xs = x.numpy()
    generator.reset()
    outs = [generator.prefill(xs[:, :prompt_len])]
    outs += [generator.decode(xs[:, i:i + 1]) for i in range(prompt_len, prompt_len + decode_steps)]
    got = np.concatenate(outs, axis=1)
    per_position = np.abs(got.astype(np.float64) - ref).max(axis=(0, 2))
    return {"prompt_len": prompt_len, "decode_steps": decode_steps, **error(got, ref),
            "worst_position": int(per_position.argmax())}
