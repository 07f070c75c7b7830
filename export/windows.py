"""The window ladder: the cache sizes W each step is exported over, the capacity C the largest.

A static graph over C cache rows pays for all C on every step (onnxruntime's CPU `Attention`
kernel scores every row whatever the mask says; an NPU cannot skip rows at all). Graphs over
W < C rows, run while the sequence fits in them, pay for W.
"""
from __future__ import annotations

from models import AttentionConfig

SMALLEST = 256  # the default ladder doubles from here up to C


class WindowError(ValueError):
    """A ladder the export cannot honour."""


def default(config: AttentionConfig) -> tuple[int, ...]:
    """256, 512, ... below C, then C itself: a long sequence switches log2(C/256) times, and a step never pays for
    more than twice the rows it uses."""
    ladder, w = [], SMALLEST
    while w < config.capacity:
        ladder.append(w)
        w *= 2
    return (*[w for w in ladder if w >= config.chunk], config.capacity)


def parse(text: str | None, config: AttentionConfig) -> tuple[int, ...]:
    """'auto' or empty -> default(config); 'none' -> (C,); '256,512' -> (256, 512, C), checked."""
    text = (text or "auto").strip()
    if text == "auto":
        return default(config)
    if text == "none":
        return (config.capacity,)
    try:
        sizes = sorted({int(w) for w in text.split(",") if w.strip()} | {config.capacity})
    except ValueError:
        raise WindowError(f"--windows {text!r}: expected comma-separated row counts, auto or none") from None
    return check(tuple(sizes), config)


def check(sizes: tuple[int, ...], config: AttentionConfig) -> tuple[int, ...]:
    bad = [w for w in sizes if not config.chunk <= w <= config.capacity]
    if bad:
        raise WindowError(f"windows {bad}: each must hold a prefill chunk and fit the cache; expected "
                          f"{config.chunk} <= W <= {config.capacity}")
    if list(sizes) != sorted(set(sizes)) or sizes[-1] != config.capacity:
        raise WindowError(f"windows {list(sizes)}: expected distinct ascending sizes ending at the capacity {config.capacity}")
    return sizes


def suffix(window: int, config: AttentionConfig) -> str:
    """The file-name part naming a window: '' for the capacity (the single-window export's names), '.w256' else."""
    return "" if window == config.capacity else f".w{window}"
