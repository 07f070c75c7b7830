"""An onnxruntime session for one step graph, with its feeds checked before they run.

Every problem with a feed is one FeedError line naming the input and what was expected,
so a caller never sees onnxruntime's own traceback for a wrong shape or position.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from .shared_weights import SharedWeights

PROVIDERS = ("cpu", "cuda", "auto")
OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
              "tensor(int32)": "int32", "tensor(bool)": "bool"}


_POOL: list[int] = []  # the threads of this process's one pool, once the process chose one (one_pool)


def one_pool(threads: int) -> None:
    """Run every StepSession this process opens on one onnxruntime thread pool of `threads` threads (0: all cores),
    for a process that runs one driver alone (python -m runtime.generate). A driver's sessions take turns, so one pool
    serves them all; with a pool each, the prefill session's threads still spin when the first decode step runs,
    which then takes 2x a later step. onnxruntime then refuses any session with a pool of its own in the process,
    so a process that opens sessions through other code (tests, the export) keeps a pool per session."""
    if not _POOL:
        ort.set_global_thread_pool_sizes(threads, 1)
        _POOL.append(threads)


class FeedError(ValueError):
    """A feed that does not fit the graph's contract."""


class ContractError(ValueError):
    """A graph that does not declare its step's inputs at the contract's shapes."""


def cuda_available() -> bool:
    return "CUDAExecutionProvider" in ort.get_available_providers()


def resolve_providers(provider: str) -> list[str]:
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}: expected one of {', '.join(PROVIDERS)}")
    if provider == "cuda" and not cuda_available():
        raise ValueError(f"provider 'cuda' requested, but this onnxruntime offers only {ort.get_available_providers()}")
    use_cuda = provider == "cuda" or (provider == "auto" and cuda_available())
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]


def check_positions(position_ids: np.ndarray, capacity: int) -> None:
    """Each row p0..p0+T-1: consecutive, starting at 0 or later, ending inside the cache."""
    if position_ids.size == 0:
        return
    if position_ids.min() < 0:
        raise FeedError(f"position_ids: min {int(position_ids.min())}; expected positions >= 0")
    if position_ids.max() >= capacity:
        raise FeedError(f"position_ids: max {int(position_ids.max())} is past the cache; expected positions < capacity {capacity}")
    steps = np.diff(position_ids, axis=-1)
    if steps.size and not (steps == 1).all():
        row = int(np.argwhere(steps != 1)[0][0])
        raise FeedError(f"position_ids: row {row} is {position_ids[row].tolist()[:8]}...; expected consecutive positions p0, p0+1, ...")


def _numpy_dtype(name: str) -> np.dtype | None:
    """None for a type numpy cannot name (no array matches it)."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


class StepSession:
    """One step graph (prefill or decode) in onnxruntime.

    `inputs`/`outputs` are the manifest's specs ({'name', 'shape', 'dtype'}); without
    them the graph's own declared (static) inputs are the contract. `cache_in_place`
    says the graph may read past_* and write present_* in one shared buffer. `weights`: read
    the graph's external weights through that one mapping, shared with the other sessions
    given it (runtime/shared_weights.py); `prepack`: pre-pack them for this session all the same.
    """

    def __init__(self, path: str | Path, inputs: list[dict] | None = None, outputs: list[dict] | None = None,
                 provider: str = "auto", threads: int = 0, opt_level: str = "all", cache_in_place: bool = False,
                 profile: bool = False, weights: SharedWeights | None = None, prepack: bool = False):
        if opt_level not in OPT_LEVELS:
            raise ValueError(f"unknown graph optimisation level {opt_level!r}: expected one of {', '.join(OPT_LEVELS)}")
        options = ort.SessionOptions()
        options.graph_optimization_level = OPT_LEVELS[opt_level]
        if _POOL:
            options.use_per_session_threads = False  # the process's one pool (one_pool), whatever `threads` says
        else:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        options.enable_profiling = profile
        if weights is not None:
            weights.share(options, path, prepack)
        self.weights = weights  # onnxruntime reads the mapping and does not keep it alive: the session does
        self.path = Path(path)
        self.cache_in_place = cache_in_place
        self.session = ort.InferenceSession(str(path), options, providers=resolve_providers(provider))
        if inputs:
            self._check_contract(inputs)
        self.inputs = inputs or [self._spec(i) for i in self.session.get_inputs()]
        self.outputs = outputs or [self._spec(o) for o in self.session.get_outputs()]
        self.capacity = next((s["shape"][2] for s in self.inputs if s["name"] == "past_key"), None)
        # Looked up on every step: dicts, not scans, and numpy dtypes, not their names.
        self._specs = {s["name"]: s for s in self.outputs + self.inputs}
        self._dtypes = {s["name"]: _numpy_dtype(s["dtype"]) for s in self.inputs}
        self.output_names = [s["name"] for s in self.outputs]

    @staticmethod
    def _spec(arg) -> dict:
        return {"name": arg.name, "shape": list(arg.shape), "dtype": _ORT_TYPES.get(arg.type, arg.type)}

    def _check_contract(self, inputs: list[dict]) -> None:
        """The graph declares each input of the contract at the contract's shape (its numbers; a symbolic dim passes):
        a graph made for another window or batch is named here, not by onnxruntime's first run."""
        declared = {i.name: i.shape for i in self.session.get_inputs()}
        for s in (s for s in inputs if s["name"] in declared):
            got = declared[s["name"]]
            if len(got) != len(s["shape"]) or any(isinstance(g, int) and g != e for g, e in zip(got, s["shape"])):
                raise ContractError(f"{self.path.name}: input {s['name']} is declared {list(got)}; the step's "
                                    f"contract expects {s['shape']}")

    @property
    def on_cuda(self) -> bool:
        return self.session.get_providers()[0] == "CUDAExecutionProvider"

    def check(self, feeds: dict) -> None:
        names = [s["name"] for s in self.inputs]
        missing, extra = [n for n in names if n not in feeds], sorted(set(feeds) - set(names))
        if missing or extra:
            raise FeedError(f"feeds: missing {missing}, unexpected {extra}; expected exactly {names}")
        for name in names:
            self.check_input(name, feeds[name])

    def spec(self, name: str) -> dict:
        return self._specs[name]

    def dtype(self, name: str) -> np.dtype | None:
        """An input's numpy dtype."""
        return self._dtypes[name]

    def check_input(self, name: str, value) -> None:
        spec = self.spec(name)
        if not isinstance(value, np.ndarray):
            raise FeedError(f"{name}: a {type(value).__name__}; expected a numpy array")
        if value.dtype != self.dtype(name):
            raise FeedError(f"{name}: dtype {value.dtype}; expected {spec['dtype']}")
        if list(value.shape) != list(spec["shape"]):
            raise FeedError(f"{name}: shape {list(value.shape)}; expected {spec['shape']}")
        if name == "position_ids" and self.capacity is not None:
            check_positions(value, self.capacity)

    def run(self, feeds: dict) -> dict:
        self.check(feeds)
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
