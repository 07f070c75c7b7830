"""Parity of onnxruntime against eager PyTorch, the only reference that counts.

The reference is the eager model in fp32 (an fp16 model's weights upcast), so an fp16
graph is measured against the truth, not against another fp16 computation.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np
import torch

from models import AttentionConfig
from models.contract import example_inputs, input_names, output_names
from models.lm import greedy

from .drivers import Driver, HostCacheGenerator
from .metrics import TOLERANCE, close, decided_rows, error, logit_error, swapped, worst
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
    computed once, then every target's graph of that step is held to it. `ref` holds cache rows from `kept` on: the
    rows before it eager left as the inputs had them (a 0.6B model's full cache is 470 MB; a case keeps it once).
    `drift`: for a model held in fp16, the max_rel of that model itself in eager PyTorch on the case, per output in
    output order (what fp16 costs it on each: metrics.fp16_tolerance); None for fp32. `decided`: then, for the whole
    model, the logit rows eager decides (metrics.decided_rows)."""
    kind: str
    p0: int
    seq_len: int
    args: tuple
    ref: tuple
    kept: int = 0
    drift: tuple[float, ...] | None = None
    decided: np.ndarray | None = None

    def expected_rows(self, i: int) -> torch.Tensor:
        """Eager's rows 0..p0+T-1 of the i-th cache."""
        if not self.kept:
            return self.ref[1 + i]
        return torch.cat([self.args[2 + i][:, :, :self.kept].float(), self.ref[1 + i]], dim=2)


def step_case(reference: torch.nn.Module, config: AttentionConfig, seq_len: int, p0: int, seed: int = 0,
              kind: str = "attention", prefix: Iterable[torch.Tensor] | Callable | None = None,
              own: torch.nn.Module | None = None) -> StepCase:
    """The case at p0 for `reference` (an fp32 eager model: reference_model). The cache rows before p0 hold what eager
    writes reading a random prefix (prefilled_inputs), as a cache only ever holds rows the model wrote: a trained
    model amplifies random rows far outside its range (SmolLM2-135M's deep layers: value rows off by 1e-4 between
    onnxruntime and torch on random rows, 2e-6 on real ones). `prefix`: prefix_caches() of at least p0 rows, shared
    by every case instead of a prefix forward each, or a function returning them (mapped from disk, one cache at a
    time: then they are dropped before the step runs, not resident beside its inputs and outputs). `own`: the graphs'
    model where it is not fp32, run on the case too for its drift."""
    args = prefilled_inputs(reference, config, seq_len, p0, seed, kind, prefix() if callable(prefix) else prefix)
    with torch.no_grad():
        out, *presents = reference(*[a.float() if a.is_floating_point() else a for a in args])
    # Only the rows up to the last written one are compared (step_parity): the rest of each cache is not kept, nor the
    # rows before p0 where eager left them as they were.
    live = p0 + seq_len
    kept = p0 if all(torch.equal(r[:, :, :p0], a[:, :, :p0].float()) for r, a in zip(presents, args[2:])) else 0
    case = StepCase(kind, p0, seq_len, args, (out, *(r[:, :, kept:live].clone() for r in presents)), kept)
    dtype = _dtype(own)
    if dtype is None or dtype == torch.float32:
        return case
    with torch.no_grad():
        out, *presents = own(*[a.to(dtype) if a.is_floating_point() else a for a in args])
    half = out.float().numpy()
    drift = tuple(e["max_rel"] for e in _case_errors(case, half, [p.float().numpy() for p in presents]))
    return replace(case, drift=drift, decided=decided_rows(case.ref[0].numpy(), half) if kind == "lm" else None)


def _dtype(model: torch.nn.Module | None) -> torch.dtype | None:
    return next(model.parameters()).dtype if model is not None else None


def _case_errors(case: StepCase, output: np.ndarray, caches: list[np.ndarray]) -> list[dict]:
    """A step's output (the LM's logits: KL and top-1 beside the normwise error) and its caches' rows up to the last
    written one against the case's eager outputs. Rows after it are unspecified by the contract, so not compared."""
    live = case.p0 + case.seq_len
    first = (logit_error if case.kind == "lm" else error)(output, case.ref[0].numpy())
    return [first] + [error(c[:, :, :live], case.expected_rows(i).numpy()) for i, c in enumerate(caches)]


def step_parity(case: StepCase, runner: StepSession | HostCacheGenerator, config: AttentionConfig) -> dict:
    """`runner` on the case's inputs against its eager outputs (_case_errors). `runner` is a step-contract session, or
    the host-cache driver of an `npu` graph (its caches set to the same rows)."""
    kind, p0, seq_len, args = case.kind, case.p0, case.seq_len, case.args
    names, outs = input_names(config, kind), output_names(config, kind)
    if isinstance(runner, HostCacheGenerator):
        for name, a in zip(names[2:], args[2:]):
            runner.caches[name][...] = a.numpy()
        out = runner.run_step("prefill" if seq_len == config.chunk else "decode", args[0].numpy(), p0)
        got = {outs[0]: out} | {"present_" + n.removeprefix("past_"): runner.caches[n] for n in names[2:]}
    else:
        got = runner.run({name: a.numpy() for name, a in zip(names, args)})
    errs = dict(zip(outs, _case_errors(case, got[outs[0]], [got[n] for n in outs[1:]])))
    if case.decided is not None:
        errs[outs[0]]["swapped"] = swapped(got[outs[0]], case.ref[0].numpy(), case.decided)
    return {"p0": p0, **worst(list(errs.values())), "per_output": errs}


def prefilled_inputs(reference: torch.nn.Module, config: AttentionConfig, seq_len: int, p0: int, seed: int = 0,
                     kind: str = "attention", prefix: Iterable[torch.Tensor] | None = None) -> tuple:
    """example_inputs, but the cache rows before p0 are what eager PyTorch writes reading a random prefix of p0
    positions (real K/V rows, in the ranges a real sequence gives); later rows stay random (the step may not read them).
    The prefix's rows come from `prefix` (prefix_caches, or an iterator over its caches) where given."""
    args = example_inputs(config, seq_len, p0, seed, kind)
    if p0 == 0:
        return args
    written = prefix_caches(reference, config, p0, seed, kind) if prefix is None else prefix
    for w, c in zip(written, args[2:], strict=True):  # in place: a copy of every cache is 470 MB at 0.6B over 2048 rows
        c[:, :, :p0] = w[:, :, :p0]
    return args


def prefix_caches(reference: torch.nn.Module, config: AttentionConfig, rows: int, seed: int = 0,
                  kind: str = "attention") -> list[torch.Tensor]:
    """Each cache's rows 0..rows-1 as eager PyTorch writes them reading a random prefix of `rows` positions (from
    position 0, in steps, so it reads only the rows it writes). A step is causal: the first p0 rows are what a p0-long
    prefix of the same inputs writes, so one prefix serves every case up to `rows`."""
    first, _, *caches = [a.float() if a.is_floating_point() else a for a in example_inputs(config, rows, 0, seed + 1, kind)]
    step = max(config.chunk, 256)  # in steps, so one forward's scores are [H, step, C], not [H, rows, C]
    with torch.no_grad():
        for start in range(0, rows, step):
            piece = first[:, start:start + step]
            t = piece.shape[1]
            _, *caches = reference(piece, (start + torch.arange(t)).expand(config.batch, t), *caches)
    return [c[:, :, :rows] for c in caches]


@dataclass(frozen=True)
class SequenceReference:
    """Eager fp32's side of a sequence check, computed once and held against every target's driver: the inputs (hidden
    states [B, P+N, E], or the prompt's token ids [B, P] and eager's greedy tokens [B, N+1] for the whole model) and
    the outputs they gave; `drift`, for a model held in fp16, the max_rel of its own eager forward in fp16 on them, and
    for the whole model the logit rows eager decides (`decided`, metrics.decided_rows)."""
    kind: str
    prompt_len: int
    decode_steps: int
    inputs: np.ndarray
    ref: np.ndarray
    tokens: np.ndarray | None = None
    drift: float | None = None
    decided: np.ndarray | None = None


def sequence_reference(model, config: AttentionConfig, prompt_len: int, decode_steps: int, seed: int = 0,
                       kind: str = "attention") -> SequenceReference:
    """A random sequence (`kind` lm: a random prompt and eager's greedy continuation) and eager's full-sequence forward
    of it, without a cache; a model not in fp32 also runs it in its own dtype, for its drift."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "lm":
        prompt = torch.randint(0, config.vocab_size, (config.batch, prompt_len), generator=gen)
        tokens, ref = greedy(reference_model(model), prompt, decode_steps + 1, config)
        reference = SequenceReference(kind, prompt_len, decode_steps, prompt.numpy(), ref.numpy(), tokens.numpy())
        own = lambda: model.forward_full(torch.cat([prompt, tokens[:, :-1]], dim=1), keep=decode_steps + 1)  # noqa: E731
    else:
        x = torch.randn(config.batch, prompt_len + decode_steps, config.hidden_size, generator=gen).to(config.torch_dtype)
        with torch.no_grad():
            ref = reference_model(model).forward_full(x.float()).numpy()
        reference = SequenceReference(kind, prompt_len, decode_steps, x.numpy(), ref)
        own = lambda: model.forward_full(x)  # noqa: E731
    if _dtype(model) == torch.float32:
        return reference
    with torch.no_grad():
        got = own().float().numpy()
    return replace(reference, drift=(logit_error if kind == "lm" else error)(got, reference.ref)["max_rel"],
                   decided=decided_rows(reference.ref, got) if kind == "lm" else None)


def compare_sequence(reference: SequenceReference, driver: Driver) -> dict:
    """The driver over the reference's sequence: a prompt in chunks, then decode steps (the whole model's on eager's
    greedy tokens), against eager's outputs. See sequence_parity and token_parity."""
    p, n = reference.prompt_len, reference.decode_steps
    driver.reset()
    if reference.kind == "lm":
        got = [driver.feed(reference.inputs)[:, -1]]
        got += [driver.decode(reference.tokens[:, i:i + 1])[:, -1] for i in range(n)]
        got = np.stack(got, axis=1)
        err = logit_error(got, reference.ref)  # eager's greedy tokens are its argmax: top1 is theirs
        if reference.decided is not None:
            err["swapped"] = swapped(got, reference.ref, reference.decided)
        return {"prompt_len": p, "decode_steps": n, **err, "top1_agreement": err["top1"]}
    xs = reference.inputs
    got = np.concatenate([driver.prefill(xs[:, :p])] + [driver.decode(xs[:, i:i + 1]) for i in range(p, p + n)], axis=1)
    per_position = np.abs(got.astype(np.float64) - reference.ref).max(axis=(0, 2))
    return {"prompt_len": p, "decode_steps": n, **error(got, reference.ref), "worst_position": int(per_position.argmax())}


def sequence_parity(model, generator: Driver, config: AttentionConfig, prompt_len: int, decode_steps: int,
                    seed: int = 0) -> dict:
    """Chunked prefill of a prompt, then decode steps, against the eager full-sequence forward (no cache)."""
    return compare_sequence(sequence_reference(model, config, prompt_len, decode_steps, seed), generator)


def token_parity(model, driver: Driver, config: AttentionConfig, prompt_len: int, decode_steps: int,
                 seed: int = 0) -> dict:
    """The whole model: a prompt fed in chunks, then decode steps on eager PyTorch's own greedy tokens (teacher
    forcing, so one near-tie cannot derail the rest), against the eager full-sequence forward at every step.

    Reports the logits' error over the steps: normwise, KL, and top-1 (how often the runtime's top-1 token is
    eager's greedy one, also under its older name `top1_agreement`).
    """
    return compare_sequence(sequence_reference(model, config, prompt_len, decode_steps, seed, "lm"), driver)
