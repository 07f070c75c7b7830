"""Qualcomm's QNN HTP (the Snapdragon NPU) through onnxruntime-qnn, in host emulation.

onnxruntime-qnn is an onnxruntime plugin carrying QNN's HTP backend and its host-side graph
compiler: a graph compiles for a chosen Snapdragon SoC and runs in an emulation of its HTP on
this machine (not on a phone). What the hand-off learned from it:

- graphs compile with CPU fallback disabled, so a compiled graph runs every node on the HTP;
- float graphs compile only with fp16 precision on (`enable_htp_fp16_precision=1`: the fp32
  RoPE tables gathered by int32 positions fail otherwise, `could not create op: q::Gather`), so
  the HTP runs our fp32 graphs in fp16 and they are judged at the fp16 tolerance; so does a
  QDQ graph's float activations (mixed precision: a trained model's residual stream), and the
  matmuls beside them keep float weights: QNN takes no per-channel DequantizeLinear outside
  a quantized group;
- `ep.context_enable` writes the compiled graph as an `EPContext` model; with `ep.share_ep_contexts`, graphs
  compiled one after another go into one context binary (embed mode 0) holding their weights once, each graph a
  small wrapper naming it in the binary: what a bundle ships. QNN's host emulation loads such a binary only while
  it holds a single graph (runtime/qnn_binary.py reads the others' metadata);
- the op trace (`enable_framework_op_trace`) says which QNN op each node became, and which
  nodes it could not take: onnxruntime's error for a graph with such nodes names none of them,
  so `session` compiles it again with CPU fallback allowed and names them from the trace.

No torch here: the bundle verifier uses it with numpy and onnxruntime alone.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

from . import metrics

# QNN's soc_model numbers for Snapdragon phones (as QNN and ExecuTorch's Qualcomm backend number them).
SOC_NAMES = {36: "SM8450 (Snapdragon 8 Gen 1, HTP v69)", 43: "SM8550 (Snapdragon 8 Gen 2, HTP v73)",
             57: "SM8650 (Snapdragon 8 Gen 3, HTP v75)", 69: "SM8750 (Snapdragon 8 Elite, HTP v79)",
             87: "SM8850 (Snapdragon 8 Elite Gen 5, HTP v81)"}
SOCS = (43, 57, 69)
TOLERANCE = metrics.TOLERANCE["fp16"]  # what the HTP runs in
# The HTP rounds every intermediate to fp16 where PyTorch's fp16 model keeps norms and softmax in fp32 and its CPU half
# kernels accumulate in fp32 (SmolLM2's decode goldens: eager fp16 3.4e-3 against fp32, its fp32 graph on the HTP
# 1.6e-2, its fp16 graph 1.9e-2): so a float graph on the HTP is held to runtime.metrics.fp16_tolerance of what fp16
# costs the model over the whole window (the bundle's fp16_drift: 1.0e-2 for SmolLM2 over 2048 rows), not on the
# graph's own few goldens, which understate what the HTP's fp16 loses.
FALLBACK = "fallback to CPU EP has been explicitly disabled"  # onnxruntime's words for nodes the HTP did not take
PARTITION_EDGE = "QNN EP is configured to not take"  # its reason for a quantize node at a partition's edge
_registered = []


def available() -> bool:
    try:
        import onnxruntime_qnn  # noqa: F401
        return True
    except ImportError:
        return False


def version() -> str:
    from onnxruntime_qnn import build_and_package_info
    return f"QNN {build_and_package_info.qnn_version} (onnxruntime-qnn)"


def _devices():
    import onnxruntime_qnn
    if not _registered:
        ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        _registered.append(True)
    return [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]


def fp16_precision(graph: dict) -> bool:
    """Whether a bundle graph (its manifest entry) needs the HTP's fp16 precision: a float graph does, and so does a QDQ
    graph keeping activations float (mixed precision); a QDQ graph quantized throughout compiles without it."""
    return "quantized" not in graph or bool(graph["quantized"].get("float_activations"))


class Refused(RuntimeError):
    """A graph the HTP cannot take whole, with the ops it refuses named (onnxruntime's own message names none)."""


def session(path: str | Path, soc: int, context: Path | None = None, trace: Path | None = None,
            fp16: bool = True, last: bool = True) -> ort.InferenceSession:
    """The graph (or a compiled EPContext model) on the HTP of SoC `soc`, every node on it; `trace` writes the op trace
    into that folder. `fp16`: run float ops in fp16 (what float graphs need); a quantized (QDQ) graph compiles without
    it. `context`: compile the graph into the context the process's earlier compiling sessions opened, writing its
    EPContext wrapper there (embed mode 0); the `last` one of them writes that context's one .bin beside the wrappers,
    every weight in it once. Raises Refused naming the ops where nodes would fall back."""
    options = _options(soc, fp16, trace)
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context is not None:
        options.add_session_config_entry("ep.context_enable", "1")
        options.add_session_config_entry("ep.context_file_path", str(context))
        options.add_session_config_entry("ep.context_embed_mode", "0")
        options.add_session_config_entry("ep.share_ep_contexts", "1")
        if last:
            options.add_session_config_entry("ep.stop_share_ep_contexts", "1")
    try:
        return ort.InferenceSession(str(path), options)
    except Exception as e:
        if FALLBACK not in str(e):
            raise
        refused = _unsupported(path, soc, fp16)
        raise Refused(f"the HTP of SoC {soc} refuses {', '.join(refused)}: {'; '.join(refused.values())}"
                      if refused else str(e)) from None


def _options(soc: int, fp16: bool, trace: Path | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a graph the HTP refuses surfaces as the exception, not as log lines
    provider = {"backend_type": "htp", "soc_model": str(soc), "enable_htp_fp16_precision": "1" if fp16 else "0"}
    if trace is not None:
        provider |= {"enable_framework_op_trace": "1", "framework_op_trace_dir": str(trace)}
    options.add_provider_for_devices(_devices(), provider)
    return options


def _unsupported(path: str | Path, soc: int, fp16: bool) -> dict[str, str]:
    """{op type: QNN's reason} for the nodes the HTP does not take: the graph again with CPU fallback allowed, where
    QNN's op trace lists them. Its quantize nodes at the edges of the HTP's partitions are listed too (QNN takes no
    QuantizeLinear of a graph input, no DequantizeLinear of a graph output), an effect of the refused nodes, not a
    cause: they are named only when nothing else is."""
    with tempfile.TemporaryDirectory() as trace:
        ort.InferenceSession(str(path), _options(soc, fp16, Path(trace)))
        nodes = _placement(Path(trace))["unsupported"]
    causes = [n for n in nodes if not n["reason"].startswith(PARTITION_EDGE)] or nodes
    return dict(sorted((n["op_type"], n["reason"].split(".")[0]) for n in causes))


def compile_shared(graphs: list[Path], soc: int, wrappers: list[Path], binary: str, fp16: list[bool]) -> dict:
    """Compile `graphs` for SoC `soc` into one context binary holding them all, each weight stored once however many
    graphs read it (QNN keeps one copy of equal constants, whatever their names), and an EPContext wrapper per graph
    (`wrappers`, in one folder) naming its graph in it; `fp16`: per graph, as `session` takes it. The binary is written
    beside the wrappers as `binary`. What each compile took and where the nodes went, the binary's size and sha256."""
    folder = wrappers[0].parent if wrappers else None
    if any(w.parent != folder for w in wrappers) or not graphs or not len(wrappers) == len(graphs) == len(fp16):
        raise ValueError("compile_shared: one wrapper and one fp16 flag per graph, the wrappers in one folder")
    before, records = set(folder.glob("*.bin")), []
    for i, (graph, wrapper, half) in enumerate(zip(graphs, wrappers, fp16)):
        with tempfile.TemporaryDirectory() as trace:
            start = time.perf_counter()
            session(graph, soc, context=wrapper, trace=Path(trace), fp16=half, last=i == len(graphs) - 1)
            records.append({"wrapper": wrapper.name, "fp16_precision": half,
                            "compile_seconds": round(time.perf_counter() - start, 1),
                            "placement": _placement(Path(trace))})
    written = sorted(set(folder.glob("*.bin")) - before)
    if len(written) != 1:
        raise RuntimeError(f"compiling {len(graphs)} graphs into one shared context wrote {len(written)} .bin files "
                           f"in {folder}; expected one")
    written[0].rename(folder / binary)
    for wrapper in wrappers:  # onnxruntime names the binary after the first wrapper; each wrapper names it
        _point(wrapper, binary)
    return {"soc_model": soc, "qnn": version(), "binary": binary,
            "bytes": (folder / binary).stat().st_size, "sha256": sha256(folder / binary), "graphs": records}


def _point(wrapper: Path, binary: str) -> None:
    """Make the EPContext wrapper's node read its context from `binary` (a file beside it)."""
    import onnx
    model = onnx.load(wrapper)
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "EPContext" and a.name == "ep_cache_context":
                a.s = binary.encode()
    onnx.save(model, wrapper)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _placement(trace: Path) -> dict:
    """From QNN's op trace: how many graph nodes became QNN ops on the HTP, and any it could not take."""
    files = list(trace.glob("*.json"))
    if not files:
        return {"htp_nodes": None, "unsupported": []}
    data = json.loads(files[0].read_text())
    sources = {s["name"] for g in data.get("subgraph_traces", []) for op in g.get("op_mappings", [])
               for s in op.get("sources", []) if s.get("type") == "OP"}
    return {"htp_nodes": len(sources), "unsupported": data.get("unsupported_nodes", [])}
