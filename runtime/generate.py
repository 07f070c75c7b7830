"""Generation-style drivers: chunked prefill, then decode steps, over a cache the runtime owns.

`Generator` keeps the cache in onnxruntime buffers on the session's device (host memory on
CPU, GPU memory on CUDA), bound with IO binding, so no cache byte crosses to the host and
nothing is allocated per step. Graphs that update the cache in place (TensorScatter,
GroupQueryAttention) get one buffer pair bound as both past_* and present_*; others read
past_* from one pair and write present_* into a second, and the pairs swap each step.

`HostCacheGenerator` drives `npu` graphs, which return only the new rows: the host keeps
the cache, builds the mask, and writes the rows back.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from .session import FeedError, StepSession


class Driver:
    """Prompt chunking and decode positions over two step sessions; subclasses own the cache."""

    def __init__(self, prefill: StepSession, decode: StepSession):
        self.prefill_session, self.decode_session = prefill, decode
        self.batch, self.chunk, self.hidden = prefill.spec("hidden_states")["shape"]
        self.cache_shape = prefill.spec("past_key")["shape"]
        self.cache_dtype = np.dtype(prefill.spec("past_key")["dtype"])
        self.capacity = self.cache_shape[2]
        self.position = 0

    def reset(self) -> None:
        """Start a new sequence; old rows need no clearing, as a query only sees rows <= its position."""
        self.position = 0

    def prefill(self, x: np.ndarray) -> np.ndarray:
        """Run a prompt [B, L, E] in chunks of T from the current position; returns [B, L, E].

        The last chunk is right-padded with zeros and its padded outputs dropped. A tail
        whose padded chunk would run past the cache goes through decode steps instead.
        """
        if x.ndim != 3 or x.shape[0] != self.batch or x.shape[2] != self.hidden:
            raise FeedError(f"prompt: shape {list(x.shape)}; expected [{self.batch}, L, {self.hidden}]")
        start, end = self.position, self.position + x.shape[1]
        if not start < end <= self.capacity:
            raise FeedError(f"prompt: length {x.shape[1]} at position {start}; expected 1..{self.capacity - start} "
                            f"to fit the cache capacity {self.capacity}")
        outputs = []
        for p0 in range(start, end, self.chunk):
            piece = x[:, p0 - start: p0 - start + self.chunk]
            n = piece.shape[1]
            if p0 + self.chunk > self.capacity:
                outputs += [self.decode(piece[:, i:i + 1]) for i in range(n)]
                continue
            if n < self.chunk:
                piece = np.concatenate([piece, np.zeros((self.batch, self.chunk - n, self.hidden), x.dtype)], axis=1)
            outputs.append(self._step(self.prefill_session, piece, p0)[:, :n])
            self.position = p0 + n
        return np.concatenate(outputs, axis=1)

    def decode(self, x: np.ndarray) -> np.ndarray:
        """One token [B, 1, E] at the current position; returns [B, 1, E]."""
        if self.position >= self.capacity:
            raise FeedError(f"decode: position {self.position} is past the cache; expected < capacity {self.capacity}")
        out = self._step(self.decode_session, x, self.position)
        self.position += 1
        return out

    def run_step(self, step: str, x: np.ndarray, p0: int) -> np.ndarray:
        """One prefill or decode step at absolute position p0 over the runtime's cache, leaving
        `position` alone: what a benchmark repeats to time a step at a given cache fill."""
        return self._step(self.prefill_session if step == "prefill" else self.decode_session, x, p0)

    def _step(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        raise NotImplementedError

    def _positions(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        """position_ids for a step at p0, after checking the step's hidden states against the graph."""
        t = session.spec("position_ids")["shape"][1]
        dtype = np.dtype(session.spec("position_ids")["dtype"])
        position_ids = np.broadcast_to(np.arange(p0, p0 + t, dtype=dtype), (self.batch, t)).copy()
        session.check_input("hidden_states", x)
        session.check_input("position_ids", position_ids)
        return position_ids


class Generator(Driver):
    def __init__(self, prefill: StepSession, decode: StepSession):
        super().__init__(prefill, decode)
        device = "cuda" if prefill.on_cuda else "cpu"
        # Zeroed, so rows no step wrote hold finite values and masked-out scores stay finite.
        # One array per buffer: on CPU an OrtValue wraps its numpy array's memory.
        new_pair = lambda: [ort.OrtValue.ortvalue_from_numpy(np.zeros(self.cache_shape, self.cache_dtype), device, 0)  # noqa: E731
                            for _ in range(2)]
        self.in_place = prefill.cache_in_place and decode.cache_in_place
        self._past = new_pair()
        self._present = self._past if self.in_place else new_pair()
        self._bindings = {}  # one IO binding per session, kept across steps
        for session in (prefill, decode):
            binding = self._bindings[id(session)] = session.session.io_binding()
            binding.bind_output("output", "cpu")
            self._bind_cache(binding)

    def _step(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        position_ids = self._positions(session, x, p0)
        binding = self._bindings[id(session)]
        binding.bind_cpu_input("hidden_states", np.ascontiguousarray(x))
        binding.bind_cpu_input("position_ids", position_ids)
        if not self.in_place:
            self._bind_cache(binding)
        session.session.run_with_iobinding(binding)
        if not self.in_place:
            self._past, self._present = self._present, self._past
        return binding.get_outputs()[0].numpy().copy()  # the binding reuses its output buffer next step

    def _bind_cache(self, binding) -> None:
        binding.bind_ortvalue_input("past_key", self._past[0])
        binding.bind_ortvalue_input("past_value", self._past[1])
        binding.bind_ortvalue_output("present_key", self._present[0])
        binding.bind_ortvalue_output("present_value", self._present[1])


class HostCacheGenerator(Driver):
    """The graph sees past_key/past_value [B, Hkv, C, D] and attention_mask [B, 1, T, C+T]:
    cache row j is visible to every query iff j < p0 (rows the host wrote before this step),
    and new row t' to query t iff t' <= t. Masked entries hold `mask_value`."""

    def __init__(self, prefill: StepSession, decode: StepSession, mask_value: float):
        super().__init__(prefill, decode)
        self.mask_value = mask_value
        self.keys = np.zeros(self.cache_shape, self.cache_dtype)
        self.values = np.zeros(self.cache_shape, self.cache_dtype)

    def _step(self, session: StepSession, x: np.ndarray, p0: int) -> np.ndarray:
        position_ids = self._positions(session, x, p0)
        t = position_ids.shape[1]
        mask = host_mask(self.batch, self.capacity, p0, t, self.mask_value, self.cache_dtype)
        out = session.run({"hidden_states": x, "position_ids": position_ids, "attention_mask": mask,
                           "past_key": self.keys, "past_value": self.values})
        self.keys[:, :, p0:p0 + t] = out["key"]
        self.values[:, :, p0:p0 + t] = out["value"]
        return out["output"]


def host_mask(batch: int, capacity: int, p0: int, t: int, mask_value: float, dtype) -> np.ndarray:
    """The npu step's attention_mask [B, 1, T, C+T]: 0 where visible, `mask_value` elsewhere."""
    visible = np.concatenate([np.broadcast_to(np.arange(capacity) < p0, (t, capacity)),
                              np.tril(np.ones((t, t), bool))], axis=1)
    mask = np.where(visible, 0.0, mask_value).astype(dtype)
    return np.broadcast_to(mask, (batch, 1, t, capacity + t)).copy()
