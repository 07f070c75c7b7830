"""Generation-style drivers: chunked prefill, then decode steps, over caches the runtime owns.

A driver reads everything it needs from the step graphs' specs: what a step takes first
(hidden states [B, T, E] for a block, token ids [B, T] for the whole model), T, and every
cache pair (`past_key`/`past_value`, or `past_key.i`/`past_value.i` for each of the LM's
layers).

`Generator` keeps the caches in onnxruntime buffers on the session's device (host memory on
CPU, GPU memory on CUDA), bound with IO binding, so no cache byte crosses to the host and
nothing is allocated per step. Graphs that update the cache in place (TensorScatter,
GroupQueryAttention) get one buffer per cache bound as both past_* and present_*; others read
past_* from one set and write present_* into a second, and the sets swap each step.

`HostCacheGenerator` drives `npu` graphs, which return only the new rows: the host keeps
the caches, builds the masks (`attention_mask`, and `attention_mask.slidingW` for layers
attending within a sliding window of W rows), and writes the rows back.

A driver may hold a ladder of windows: the same steps exported over caches of W rows for a few W
(the largest the capacity C), each attending over rows 0..W-1 only. Every step runs in the smallest
window holding its last position; the caches live in one host buffer each, sized for C and laid out
as [B, Hkv, W, D] for the window in use, so a switch moves the rows in use once and allocates nothing.
Every window's sessions are open before the first step (runtime/artifacts.py): a window opened on its first use
stalled that step by its sessions' open time, about 1.4 s each for SmolLM2-135M.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import onnxruntime as ort

from .session import FeedError, StepSession

Steps = tuple[StepSession, StepSession]  # one window's (prefill, decode) sessions


class Driver:
    """Prompt chunking and decode positions over step sessions; subclasses own the caches."""

    def __init__(self, prefill: StepSession, decode: StepSession, larger: dict[int, Steps] | None = None):
        """`prefill`/`decode`: the sessions of the only window, or of a ladder's smallest; `larger` maps each larger
        window of the ladder to its (prefill, decode) sessions."""
        first = prefill.inputs[0]
        self.input_name, self.input_dtype = first["name"], np.dtype(first["dtype"])
        self.batch, self.chunk, *self.features = first["shape"]
        self.past = [s["name"] for s in prefill.inputs if s["name"].startswith("past_")]
        self.cache_dtype = np.dtype(prefill.spec(self.past[0])["dtype"])
        self.window = prefill.spec(self.past[0])["shape"][2]
        self._windows = {self.window: (prefill, decode), **(larger or {})}
        if min(self._windows) != self.window:
            raise ValueError(f"a ladder's first sessions must be its smallest window; got {self.window}, "
                             f"expected {min(self._windows)}")
        self.windows = sorted(self._windows)
        self.capacity = self.windows[-1]
        self.output_name = prefill.outputs[0]["name"]
        self.position = 0

    def cache_shape(self, window: int) -> list[int]:
        b, kv, _, d = self.prefill_session.spec(self.past[0])["shape"]
        return [b, kv, window, d]

    @property
    def prefill_session(self) -> StepSession:
        return self._sessions(self.window)[0]

    @property
    def decode_session(self) -> StepSession:
        return self._sessions(self.window)[1]

    def _sessions(self, window: int) -> Steps:
        return self._windows[window]

    def reset(self) -> None:
        """Start a new sequence; old rows need no clearing, as a query only sees rows <= its position."""
        self.position = 0

    def warm(self) -> None:
        """Run each window's decode step once, at the window's last row, so that no step a user waits for is a
        session's first run: a first run sets up its buffers, about 2x a later step (in a ladder, at a window crossing).
        The rows it writes are past any a sequence has written (unspecified until one does); it ends where an opened
        driver starts, in the smallest window at position 0."""
        token, smallest = np.zeros((self.batch, 1, *self.features), self.input_dtype), self.windows[0]
        for window in self.windows:
            self._run("decode", token, window - 1)
        if self.window != smallest:  # back where an opened driver starts
            self._move(smallest)
            self.window = smallest
        self.reset()

    def _check_prompt(self, x: np.ndarray) -> None:
        if x.ndim != 2 + len(self.features) or x.shape[0] != self.batch or list(x.shape[2:]) != self.features:
            want = ", ".join(str(d) for d in [self.batch, "L", *self.features])
            raise FeedError(f"prompt: shape {list(x.shape)}; expected [{want}]")
        start, end = self.position, self.position + x.shape[1]
        if not start < end <= self.capacity:
            raise FeedError(f"prompt: length {x.shape[1]} at position {start}; expected 1..{self.capacity - start} "
                            f"to fit the cache capacity {self.capacity}")

    def prefill(self, x: np.ndarray) -> np.ndarray:
        """Run a prompt [B, L, ...] in chunks of T from the current position; returns every position's output.

        The last chunk is right-padded and its padded outputs dropped. A tail whose padded chunk
        would run past the cache goes through decode steps instead.
        """
        self._check_prompt(x)
        start = self.position
        outputs = [self._chunk(x[:, a - start:b - start], a)[:, :b - a] for a, b in self._spans(start, start + x.shape[1])]
        return np.concatenate(outputs, axis=1)

    def feed(self, x: np.ndarray) -> np.ndarray:
        """Run a prompt [B, L, ...] so that its last element is the last row of a step; returns that step's output
        (the whole model's: the logits after the prompt).

        Chunks end at the prompt's end: a partial chunk goes first (right-padded; the next chunk overwrites
        its padded cache rows before any query reads them), and a prompt shorter than T is a padded chunk
        of all but its last element, then a decode step.
        """
        self._check_prompt(x)
        start, length = self.position, x.shape[1]
        if length < self.chunk:
            spans = self._spans(start, start + length - 1) if length > 1 else []
            spans.append((start + length - 1, start + length))
        else:
            rest = length % self.chunk
            spans = [(start, start + rest)] * bool(rest) + self._spans(start + rest, start + length)
        for a, b in spans:
            out = self._chunk(x[:, a - start:b - start], a)
        return out

    def _spans(self, start: int, end: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk, end)) for a in range(start, end, self.chunk)]

    def _chunk(self, piece: np.ndarray, p0: int) -> np.ndarray:
        """Positions p0 .. p0 + n - 1: one prefill step (padded), or decode steps where a padded chunk would run
        past the cache (or for a single element); returns the step outputs and moves `position` past them."""
        n = piece.shape[1]
        if n == 1 or p0 + self.chunk > self.capacity:
            self.position = p0
            return np.concatenate([self.decode(piece[:, i:i + 1]) for i in range(n)], axis=1) if n > 1 \
                else self.decode(piece)
        if n < self.chunk:
            pad = np.zeros((self.batch, self.chunk - n, *self.features), piece.dtype)
            piece = np.concatenate([piece, pad], axis=1)
        out = self._run("prefill", piece, p0)
        self.position = p0 + n
        return out

    def decode(self, x: np.ndarray) -> np.ndarray:
        """One element [B, 1, ...] at the current position; returns its output."""
        if self.position >= self.capacity:
            raise FeedError(f"decode: position {self.position} is past the cache; expected < capacity {self.capacity}")
        out = self._run("decode", x, self.position)
        self.position += 1
        return out

    def run_step(self, step: str, x: np.ndarray, p0: int) -> np.ndarray:
        """One prefill or decode step at absolute position p0 over the runtime's caches, leaving
        `position` alone: what a benchmark repeats to time a step at a given cache fill."""
        return self._run(step, x, p0)

    def _run(self, step: str, x: np.ndarray, p0: int) -> np.ndarray:
        """The step in the smallest window holding its last position (the cache moved there first)."""
        last = p0 + (1 if step == "decode" else self.chunk)
        if not 0 <= p0 < last <= self.capacity:
            raise FeedError(f"{step} at position {p0}: rows {p0}..{last - 1}; expected them inside the cache "
                            f"(0..{self.capacity - 1})")
        window = next(w for w in self.windows if w >= last)
        if window != self.window:
            self._move(window)
            self.window = window
        return self._step(self._sessions(window)[step != "prefill"], x, p0)

    def _step(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        raise NotImplementedError

    def _move(self, window: int) -> None:
        """Lay the caches out for `window` (from `self.window`), keeping the rows both hold."""
        raise NotImplementedError

    def _inputs(self, session: StepSession, x: np.ndarray, p0: int) -> tuple[np.ndarray, np.ndarray]:
        """(the step's input, checked against the graph, and position_ids p0.. for it; _run has checked that they fit);
        token ids are taken in any integer type (npu graphs read int32)."""
        t = session.spec("position_ids")["shape"][1]
        position_ids = np.empty((self.batch, t), session.dtype("position_ids"))
        position_ids[:] = np.arange(p0, p0 + t)
        if isinstance(x, np.ndarray) and x.dtype.kind in "iu" and self.input_dtype.kind == "i":
            x = x.astype(self.input_dtype, copy=False)
        session.check_input(self.input_name, x)
        return x, position_ids


class CacheBuffers:
    """One zeroed host buffer per cache, sized for the largest window and viewed as [B, Hkv, W, D] for the window
    in use. Zeroed, so rows no step wrote hold finite values and masked-out scores stay finite; written (np.full,
    not np.zeros), so every page is the buffer's own from the start: untouched np.zeros pages all map one shared
    zero page, which a kernel reading rows no step wrote reads from cache, not memory (a benchmark over a fresh
    buffer would time less memory traffic than a cache that has held a sequence)."""

    def __init__(self, driver: Driver):
        # the shape, not the driver: a buffer holding its driver made a cycle that kept every session of a closed
        # driver (a 135M model's ladder: GBs of weights) alive until Python's cyclic collector happened to run
        b, kv, rows, d = driver.cache_shape(driver.capacity)
        self._shape = lambda window: [b, kv, window, d]
        size = b * kv * rows * d
        self._flat = [np.full(size, 0, driver.cache_dtype) for _ in driver.past]

    def view(self, window: int) -> list[np.ndarray]:
        shape = self._shape(window)
        return [flat[:math.prod(shape)].reshape(shape) for flat in self._flat]

    def move(self, old: int, new: int) -> list[np.ndarray]:
        """The views for window `new`, holding the first min(old, new) rows the `old` views held (rows past them are
        unspecified: whatever finite values the buffer held). The rows move in place, one (batch, head) block at a
        time, in the order that reads every block before any other block's rows overwrite it: last first when the
        window grows, first first when it shrinks."""
        b, kv, _, d = self._shape(1)
        keep, blocks = min(old, new) * d, range(b * kv)
        for flat in self._flat:
            for i in (reversed(blocks) if new > old else blocks):
                if i:  # block 0 starts at 0 in every layout
                    flat[i * new * d:i * new * d + keep] = flat[i * old * d:i * old * d + keep]
        return self.view(new)


class Generator(Driver):
    def __init__(self, prefill: StepSession, decode: StepSession, larger: dict[int, Steps] | None = None):
        super().__init__(prefill, decode, larger)
        self.device = "cuda" if prefill.on_cuda else "cpu"
        self.in_place = prefill.cache_in_place and decode.cache_in_place
        self._past_buffers = CacheBuffers(self)
        self._present_buffers = self._past_buffers if self.in_place else CacheBuffers(self)
        self._bindings = {}  # one IO binding per session, kept across steps
        self._bind(self.window, self._past_buffers.view(self.window))

    def _bind(self, window: int, rows: list[np.ndarray]) -> None:
        """Cache values for `window` holding `rows`, bound to both its sessions. On CPU an OrtValue wraps its
        array's memory, so the values are the buffers; on CUDA they are copies in device memory."""
        value = lambda a: ort.OrtValue.ortvalue_from_numpy(a, self.device, 0)  # noqa: E731
        self._past = [value(a) for a in rows]
        self._present = self._past if self.in_place else [value(a) for a in self._present_buffers.view(window)]
        for session in self._sessions(window):
            if id(session) not in self._bindings:
                self._bindings[id(session)] = HostIO(session, self.input_name, self.output_name)
            self._bind_cache(self._bindings[id(session)].binding)

    def _move(self, window: int) -> None:
        if self.device != "cpu":  # the rows in use come back to the host buffers first
            for view, value in zip(self._past_buffers.view(self.window), self._past):
                view[...] = value.numpy()
        self._bind(window, self._past_buffers.move(self.window, window))

    def _step(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        io = self._bindings[id(session)]
        io.input[...], io.positions[...] = self._inputs(session, x, p0)
        if not self.in_place:
            self._bind_cache(io.binding)
        session.session.run_with_iobinding(io.binding)
        if not self.in_place:
            self._past, self._present = self._present, self._past
            self._past_buffers, self._present_buffers = self._present_buffers, self._past_buffers
        return io.output.copy()  # the binding writes into the same array next step

    def _bind_cache(self, binding) -> None:
        for name, past, present in zip(self.past, self._past, self._present):
            binding.bind_ortvalue_input(name, past)
            binding.bind_ortvalue_output("present_" + name.removeprefix("past_"), present)


class HostIO:
    """A session's IO binding with its step input, position_ids and output bound once to host arrays, which each
    step writes and reads in place: binding fresh arrays every step, and wrapping every bound output (the caches
    too) to read the one it returns, cost ~50 us a token, 2% of an int4 decode step."""

    def __init__(self, session: StepSession, input_name: str, output_name: str):
        self.binding = session.session.io_binding()
        host = lambda name: np.empty(session.spec(name)["shape"], np.dtype(session.spec(name)["dtype"]))  # noqa: E731
        self.input, self.positions, self.output = host(input_name), host("position_ids"), host(output_name)
        self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self.input, self.positions, self.output)]
        self.binding.bind_ortvalue_input(input_name, self._values[0])
        self.binding.bind_ortvalue_input("position_ids", self._values[1])
        self.binding.bind_ortvalue_output(output_name, self._values[2])


class HostCacheGenerator(Driver):
    """The graph sees the caches [B, Hkv, W, D] and attention_mask [B, 1, T, W+T]: cache row j is visible
    to every query iff j < p0 (rows the host wrote before this step), and new row t' to query t iff
    t' <= t. Masked entries hold `mask_value`. The graph returns each cache's new rows (key, or key.i)."""

    def __init__(self, prefill: StepSession, decode: StepSession, mask_value: float,
                 larger: dict[int, Steps] | None = None):
        super().__init__(prefill, decode, larger)
        self.mask_value = mask_value
        self._buffers = CacheBuffers(self)
        self.caches = dict(zip(self.past, self._buffers.view(self.window)))
        self._mask_windows: dict[StepSession, dict[str, int]] = {}

    def _move(self, window: int) -> None:
        self.caches = dict(zip(self.past, self._buffers.move(self.window, window)))

    def _masks_of(self, session: StepSession) -> dict[str, int]:
        """The mask inputs `session`'s graph reads and their windows, parsed once per session (_step is the hot path)."""
        if session not in self._mask_windows:
            self._mask_windows[session] = mask_inputs(s["name"] for s in session.inputs)
        return self._mask_windows[session]

    def _step(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        x, position_ids = self._inputs(session, x, p0)  # checked; the masks and caches are the driver's own
        t = position_ids.shape[1]
        masks = {name: host_mask(self.batch, self.window, p0, t, self.mask_value, self.cache_dtype, sliding)
                 for name, sliding in self._masks_of(session).items()}
        out = self.infer(session, {self.input_name: x, "position_ids": position_ids, **masks, **self.caches})
        for name, cache in self.caches.items():
            cache[:, :, p0:p0 + t] = out[name.removeprefix("past_")]
        return out[self.output_name]

    def infer(self, session: StepSession, feeds: dict) -> dict:
        """One run of a step graph on feeds the driver made (what export/quantize.py wraps to record them)."""
        return dict(zip(session.output_names, session.session.run(session.output_names, feeds)))


SLIDING_MASK = "attention_mask.sliding"


def mask_input_name(sliding: int) -> str:
    """The npu step's mask input for the layers attending within `sliding` rows (0: the plain causal mask)."""
    return f"{SLIDING_MASK}{sliding}" if sliding else "attention_mask"


def mask_inputs(names) -> dict[str, int]:
    """{mask input: its sliding window (0: none)} among a step's input names."""
    names = list(names)
    found = {n: 0 for n in names if n == "attention_mask"}
    found.update({n: int(n.removeprefix(SLIDING_MASK)) for n in names if n.startswith(SLIDING_MASK)})
    return found


def host_mask(batch: int, capacity: int, p0: int, t: int, mask_value: float, dtype, sliding: int = 0) -> np.ndarray:
    """The npu step's attention_mask [B, 1, T, C+T]: 0 where visible, `mask_value` elsewhere. With `sliding` = W
    (attention_mask.slidingW), query p0+i sees only the rows within W of it: positions p0+i-W+1 .. p0+i."""
    mask = np.full((batch, 1, t, capacity + t), mask_value, dtype)
    if sliding:
        distance = p0 + np.arange(t)[:, None] - np.arange(p0)[None]
        mask[..., :p0] = np.where(distance < sliding, 0, mask_value)
    else:
        mask[..., :p0] = 0
    mask[..., capacity:] = _causal(t, mask_value, np.dtype(dtype), sliding)
    return mask


@functools.cache
def _causal(t: int, mask_value: float, dtype: np.dtype, sliding: int = 0) -> np.ndarray:
    """The mask among a step's own T rows: the same every step, so made once."""
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    keep = (j <= i) & ((i - j < sliding) if sliding else True)
    return np.where(keep, 0, mask_value).astype(dtype)
