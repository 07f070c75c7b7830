"""How far a quantized whole model is from fp32 eager PyTorch, measured on a fixed prompt set.

With random weights the top-1 margins are tiny, so a single flipped token says little: the
distribution measures come first. For every prompt, the model reads the prompt, then decodes
eager PyTorch's own greedy continuation (teacher forcing, so every step sees the same
context), and each step's next-token logits are compared with eager's:

- max_rel / mean_rel: max |logits - eager| / max |eager| per step, worst and mean over steps;
- kl_mean / kl_max: KL(eager || model) of the next-token distributions, in nats;
- top1: how often the model's argmax is eager's;
- greedy_match: free-running greedy generation, the share of the N tokens generated before
  the first one that differs from eager's greedy continuation; greedy_tokens: that count per prompt;
  ties: the prompts whose first differing token was a tie in the reference (its logit within TIE of the
  reference's choice: either is a right greedy token), with the step and the margin.

The export holds a quantized target's figures to its scheme's budget (max_rel, kl_mean, top1;
export/quantize.py) and refuses the graphs past it.

Any object with `reset()`, `feed(ids [1, L]) -> logits [1, 1, V]` and `decode(ids [1, 1])`
is measured the same way: the runtime's drivers, and onnxruntime-genai (benchmarks/peers.py).
"""
from __future__ import annotations

import numpy as np
import torch

from models.lm import greedy

from .metrics import distribution

PROMPTS = 4
DECODE_STEPS = 16
TIE = 1e-4  # a token whose reference logit is this close to the reference's top-1 is as right a greedy choice


def prompt_set(config, seed: int = 1234) -> list[np.ndarray]:
    """PROMPTS prompts of token ids [B, L] (one prompt per batch row repeated), lengths spread over one to three
    chunks (within the capacity)."""
    rng = np.random.default_rng(seed)
    longest = config.capacity - DECODE_STEPS - 1
    lengths = [min(n, longest) for n in (config.chunk // 2 + 1, config.chunk + 3, 2 * config.chunk + 5, 3 * config.chunk - 1)]
    return [np.repeat(rng.integers(0, config.vocab_size, (1, n)), config.batch, axis=0) for n in lengths[:PROMPTS]]


def references(model, prompts: list[np.ndarray], config=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Eager fp32's greedy continuation of each prompt and the logits that chose it ([N], [N, V]) (`config`: the
    model's, for models/lm.greedy's cached proposals)."""
    out = []
    for p in prompts:
        tokens, logits = greedy(model, torch.from_numpy(p[:1]), DECODE_STEPS + 1, config)
        out.append((tokens[0].numpy(), logits[0].numpy()))
    return out


def measure(driver, prompts: list[np.ndarray], refs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """The figures above for `driver` over the prompt set (each reference's length sets the decode steps)."""
    per_step, runs, ties = [], [], []
    for k, (prompt, (tokens, ref)) in enumerate(zip(prompts, refs)):
        steps = len(tokens) - 1
        driver.reset()
        column = lambda token: np.full((prompt.shape[0], 1), token)  # noqa: E731
        got = [driver.feed(prompt)[0, -1]] + [driver.decode(column(tokens[i]))[0, -1] for i in range(steps)]
        per_step.append(distribution(np.stack(got), ref))
        driver.reset()
        nxt, run = int(np.argmax(driver.feed(prompt)[0, -1])), 0
        while run < steps and nxt == tokens[run]:
            run += 1
            nxt = int(np.argmax(driver.decode(column(nxt))[0, -1]))
        runs.append(run)
        if run < steps and (margin := float(ref[run, tokens[run]] - ref[run, nxt])) <= TIE:
            ties.append({"prompt": k, "step": run, "margin": margin})
    rel, kl = np.concatenate([s["rel"] for s in per_step]), np.concatenate([s["kl"] for s in per_step])
    lengths = [len(t) - 1 for t, _ in refs]
    return {"max_rel": float(rel.max()), "mean_rel": float(rel.mean()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "top1": float(np.concatenate([s["top1"] for s in per_step]).mean()),
            "greedy_match": float(np.mean([r / n for r, n in zip(runs, lengths)])), "greedy_tokens": runs, "ties": ties,
            "prompts": [int(p.shape[1]) for p in prompts], "decode_steps": max(lengths)}
