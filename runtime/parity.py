"""Parity of onnxruntime against eager PyTorch, the only reference that counts.

The reference is the eager model in fp32 (an fp16 model's weights upcast), so an fp16
graph is measured against the truth, not against another fp16 computation.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from models import AttentionConfig
from models.contract import example_inputs, input_names, output_names
from models.lm import greedy

from .drivers import Driver, HostCacheGenerator
from .metrics import TOLERANCE, close, error, logit_error, worst
from .session import StepSession


def within(err: dict, dtype: str) -> bool:
    return close(err, TOLERANCE[dtype])


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model in fp32, in eval mode: itself when it is fp32 already (a copy of a billion-parameter model is
    gigabytes), else an upcast copy (Module.float() converts in place, so the graphs' own model stays as it is)."""
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return model.eval()
    return copy.deepcopy(model).float().eval()


@dataclass(frozen=True)
class StepCase:
    """One step's inputs at positions p0..p0+T-1 and eager fp32's outputs for them (the caches' rows up to p0+T-1):
    computed once, then every target's graph of that step is held to it."""
    kind: str
    p0: int
    seq_len: int
    args: tuple
    ref: tuple


def step_case(reference: torch.nn.Module, config: AttentionConfig, seq_len: int, p0: int, seed: int = 0,
              kind: str = "attention") -> StepCase:
    """The case at p0 for `reference` (an fp32 eager model: reference_model). The cache rows before p0 hold what eager
    writes reading a random prefix (prefilled_inputs), as a cache only ever holds rows the model wrote: a trained
    model amplifies random rows far outside its range (SmolLM2-135M's deep layers: value rows off by 1e-4 between
    onnxruntime and torch on random rows, 2e-6 on real ones)."""
    args = prefilled_inputs(reference, config, seq_len, p0, seed, kind)
    with torch.no_grad():
        out, *presents = reference(*[a.float() if a.is_floating_point() else a for a in args])
    # Only the rows up to the last written one are compared (step_parity): the rest of each cache is not kept, as a
    # step's cases are held while every target is checked on them (a whole model's caches are gigabytes).
    live = p0 + seq_len
    return StepCase(kind, p0, seq_len, args, (out, *(r[:, :, :live].clone() for r in presents)))


def step_parity(case: StepCase, runner: StepSession | HostCacheGenerator, config: AttentionConfig) -> dict:
    """`runner` on the case's inputs against its eager outputs: the output (the LM's logits: KL and top-1 beside the
    normwise error) and the written cache rows. `runner` is a step-contract session, or the host-cache driver of an
    `npu` graph (its caches set to the same rows). Rows after the last written one are unspecified by the contract,
    so they are not compared."""
    kind, p0, seq_len, args = case.kind, case.p0, case.seq_len, case.args
    names, outs = input_names(config, kind), output_names(config, kind)
    if isinstance(runner, HostCacheGenerator):
        for name, a in zip(names[2:], args[2:]):
            runner.caches[name][...] = a.numpy()
        out = runner.run_step("prefill" if seq_len == config.chunk else "decode", args[0].numpy(), p0)
        got = {outs[0]: out} | {"present_" + n.removeprefix("past_"): runner.caches[n] for n in names[2:]}
    else:
        got = runner.run({name: a.numpy() for name, a in zip(names, args)})
    live = p0 + seq_len
    errs = {outs[0]: (logit_error if kind == "lm" else error)(got[outs[0]], case.ref[0].numpy())}
    errs |= {n: error(got[n][:, :, :live], r.numpy()) for n, r in zip(outs[1:], case.ref[1:])}
    return {"p0": p0, **worst(list(errs.values())), "per_output": errs}


def prefilled_inputs(reference: torch.nn.Module, config: AttentionConfig, seq_len: int, p0: int, seed: int = 0,
                     kind: str = "attention") -> tuple:
    """example_inputs, but the cache rows before p0 are what eager PyTorch writes reading a random prefix of p0
    positions (real K/V rows, in the ranges a real sequence gives); later rows stay random (the step may not read them)."""
    args = example_inputs(config, seq_len, p0, seed, kind)
    if p0 == 0:
        return args
    prefix = example_inputs(config, p0, 0, seed + 1, kind)  # from position 0, so it reads only the rows it writes
    with torch.no_grad():
        written = reference(*[a.float() if a.is_floating_point() else a for a in prefix])[1:]
    caches = [torch.cat([w[:, :, :p0].to(c.dtype), c[:, :, p0:]], dim=2) for w, c in zip(written, args[2:])]
    return (*args[:2], *caches)


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


def token_parity(model, driver: Driver, config: AttentionConfig, prompt_len: int, decode_steps: int,
                 seed: int = 0) -> dict:
    """The whole model: a prompt fed in chunks, then decode steps on eager PyTorch's own greedy tokens (teacher
    forcing, so one near-tie cannot derail the rest), against the eager full-sequence forward at every step.

    Reports the logits' error over the steps: normwise, KL, and top-1 (how often the runtime's top-1 token is
    eager's greedy one, also under its older name `top1_agreement`).
    """
    prompt = torch.randint(0, config.vocab_size, (config.batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    tokens, ref = greedy(reference_model(model), prompt, decode_steps + 1)
    driver.reset()
    got = [driver.feed(prompt.numpy())[:, -1]]
    got += [driver.decode(tokens[:, i:i + 1].numpy())[:, -1] for i in range(decode_steps)]
    err = logit_error(np.stack(got, axis=1), ref.numpy())  # eager's greedy tokens are its logits' argmax: top1 is theirs
    return {"prompt_len": prompt_len, "decode_steps": decode_steps, **err, "top1_agreement": err["top1"]}
