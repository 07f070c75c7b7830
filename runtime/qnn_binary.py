"""What a QNN context binary holds, read by QNN's own libQnnSystem (shipped beside onnxruntime-qnn's provider).

QNN's host emulation of the HTP loads a context binary holding one graph, but not one holding several (onnxruntime-qnn
2.7.0 crashes in it, 2.4.0 reports QNN_COMMON_ERROR_NOT_SUPPORTED), and a weight-shared binary holds every step graph
of a part. Its system library still reads such a binary without a backend: which graphs it holds, each one's inputs and
outputs, the SoC and the QNN build it was compiled for. `binary_info` returns that, through the library's C API
(ctypes; the layouts are those of QNN's public headers, System/QnnSystemContext.h and QnnTypes.h, versioned structs
whose leading fields never move).

No torch here: the bundle verifier reads binaries with numpy and onnxruntime-qnn alone.
"""
from __future__ import annotations

import ctypes as C
import mmap
from pathlib import Path


class BinaryError(ValueError):
    """A file libQnnSystem does not read as a context binary."""


class _Version(C.Structure):
    _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32), ("patch", C.c_uint32)]


_Create = C.CFUNCTYPE(C.c_uint64, C.POINTER(C.c_void_p))
_GetBinaryInfo = C.CFUNCTYPE(C.c_uint64, C.c_void_p, C.c_void_p, C.c_uint64, C.POINTER(C.c_void_p),
                             C.POINTER(C.c_uint64))
_Free = C.CFUNCTYPE(C.c_uint64, C.c_void_p)


class _SystemTable(C.Structure):  # QnnSystemInterface_ImplementationV1_x_t: its first four entries
    _fields_ = [("create", _Create), ("get_binary_info", _GetBinaryInfo), ("get_metadata", C.c_void_p),
                ("free", _Free)]


class _SystemInterface(C.Structure):  # QnnSystemInterface_t
    _fields_ = [("backend_id", C.c_uint32), ("provider", C.c_char_p), ("version", _Version), ("table", _SystemTable)]


class _BinaryInfoV3(C.Structure):  # QnnSystemContext_BinaryInfoV3_t
    _fields_ = [("backend_id", C.c_uint32), ("build_id", C.c_char_p), ("core_api", _Version),
                ("backend_api", _Version), ("soc_version", C.c_char_p), ("blob_version", _Version),
                ("context_blob_size", C.c_uint64), ("num_context_tensors", C.c_uint32), ("context_tensors", C.c_void_p),
                ("num_graphs", C.c_uint32), ("graphs", C.c_void_p), ("platform_info", C.c_void_p),
                ("metadata_size", C.c_uint32), ("metadata", C.c_void_p), ("soc_model", C.c_uint32)]


class _BinaryInfo(C.Structure):
    _fields_ = [("version", C.c_uint32), ("v3", _BinaryInfoV3)]


class _GraphInfo(C.Structure):  # QnnSystemContext_GraphInfo_t (V1..V3 share these leading fields; V3 is the largest)
    _fields_ = [("version", C.c_uint32), ("name", C.c_char_p), ("num_inputs", C.c_uint32), ("inputs", C.c_void_p),
                ("num_outputs", C.c_uint32), ("outputs", C.c_void_p), ("_rest", C.c_byte * 40)]


class _Tensor(C.Structure):  # Qnn_Tensor_t: its version, then Qnn_TensorV1_t's (and V2's) leading fields
    _fields_ = [("version", C.c_uint32), ("_pad", C.c_uint32), ("id", C.c_uint32), ("name", C.c_char_p),
                ("type", C.c_uint32), ("data_format", C.c_uint32), ("data_type", C.c_uint32),
                ("quantize_params", C.c_uint64 * 5), ("rank", C.c_uint32), ("dimensions", C.POINTER(C.c_uint32)),
                ("_rest", C.c_byte * 48)]


assert C.sizeof(_GraphInfo) == 88 and C.sizeof(_Tensor) == 144  # the headers' sizeof, x86-64 and arm64 alike
_KINDS = {0: "int", 1: "uint", 2: "float", 3: "sfixed", 4: "ufixed", 5: "bool"}


def data_type(code: int) -> str:
    """QNN's Qnn_DataType_t as a name: its high byte is the kind, its low byte the bits written in hex digits that read
    as decimal (QNN_DATATYPE_FLOAT_32 = 0x0232 -> 'float32'); BFLOAT_16 is the one exception."""
    if code == 0x0226:
        return "bfloat16"
    kind, bits = _KINDS.get(code >> 8), f"{code & 0xFF:x}"
    return f"{kind}{bits}" if kind and bits.isdigit() else f"0x{code:04x}"


def _library() -> C.CDLL:
    import onnxruntime_qnn
    return C.CDLL(str(Path(onnxruntime_qnn.__file__).parent / "libQnnSystem.so"))


def _interface() -> _SystemInterface:
    providers, count = C.POINTER(C.POINTER(_SystemInterface))(), C.c_uint32()
    if _library().QnnSystemInterface_getProviders(C.byref(providers), C.byref(count)) or not count.value:
        raise RuntimeError("libQnnSystem offers no system interface")
    return providers[0].contents


def _tensors(address: int, count: int) -> list[dict]:
    array = C.cast(address, C.POINTER(_Tensor))
    return [{"name": t.name.decode(), "dtype": data_type(t.data_type), "shape": [t.dimensions[d] for d in range(t.rank)]}
            for t in (array[i] for i in range(count))]


def binary_info(path: str | Path) -> dict:
    """{"build": QNN build id, "soc_model", "context_bytes", "graphs": [{"name", "inputs", "outputs"}]} of the context
    binary at `path`; each tensor {"name", "dtype", "shape"}. Raises BinaryError if libQnnSystem does not read it."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        raise BinaryError(f"{path}: no such file, or empty; expected a QNN context binary")
    table, handle = _interface().table, C.c_void_p()
    if table.create(C.byref(handle)):
        raise RuntimeError("libQnnSystem could not create a system context")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as data:
            buffer = (C.c_char * len(data)).from_buffer(data)  # mapped, not read: a part's binary is a gigabyte
            info, size = C.c_void_p(), C.c_uint64()
            status = table.get_binary_info(handle, C.addressof(buffer), len(data), C.byref(info), C.byref(size))
            described = _describe(C.cast(info, C.POINTER(_BinaryInfo)).contents) if not status and info.value else None
            del buffer  # the mapping closes only once no ctypes object points into it
    finally:
        table.free(handle)
    if described is None:
        raise BinaryError(f"{path}: libQnnSystem does not read it as a QNN context binary (error {status}); expected "
                          "a context binary written by onnxruntime-qnn or qnn-context-binary-generator")
    return described


def _describe(info: _BinaryInfo) -> dict:
    if info.version != 3:
        raise BinaryError(f"context binary info version {info.version}; expected 3 (QNN 2.2x and later)")
    v3 = info.v3
    graphs = C.cast(v3.graphs, C.POINTER(_GraphInfo))
    return {"build": v3.build_id.decode(), "soc_model": v3.soc_model, "context_bytes": v3.context_blob_size,
            "graphs": [{"name": g.name.decode(), "inputs": _tensors(g.inputs, g.num_inputs),
                        "outputs": _tensors(g.outputs, g.num_outputs)}
                       for g in (graphs[i] for i in range(v3.num_graphs))]}


def _signature(tensors) -> list[tuple]:
    return [(t["name"], tuple(t["shape"]), t["dtype"]) for t in tensors]


def _onnx_signature(values) -> list[dict]:
    import onnx
    return [{"name": v.name, "shape": [d.dim_value for d in v.type.tensor_type.shape.dim],
             "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name} for v in values]


def _difference(qnn: list[dict], source: list[dict]) -> str | None:
    """The first of QNN's tensors that is not the source graph's (name, shape, and dtype unless QNN's is fixed-point:
    a QDQ graph whose I/O quantization onnxruntime runs on the CPU), said in a few words; None if they all are."""
    if len(qnn) != len(source):
        return f"{len(qnn)} tensors against {len(source)}"
    for q, s in zip(_signature(qnn), _signature(source)):
        if q[:2] != s[:2] or (q[2] != s[2] and not q[2].startswith(("ufixed", "sfixed"))):
            return f"{q[0]} {list(q[1])} {q[2]} against {s[0]} {list(s[1])} {s[2]}"
    return None


def check_wrapper(wrapper: str | Path, source: str | Path) -> dict:
    """The graph a shipped EPContext wrapper runs, checked against the ONNX graph it was compiled from: the wrapper's
    one EPContext node names a context binary beside it (embed mode 0) and a graph in it, and that graph's inputs and
    outputs are the source graph's (names, shapes: a wrapper pointing at another window's graph has other cache
    shapes). Returns the graph's binary_info entry with the binary's file, build and SoC; raises BinaryError naming
    what differs."""
    import onnx
    wrapper, source = Path(wrapper), Path(source)
    nodes = onnx.load(wrapper, load_external_data=False).graph.node
    if len(nodes) != 1 or nodes[0].op_type != "EPContext":
        raise BinaryError(f"{wrapper.name}: {len(nodes)} nodes ({', '.join(n.op_type for n in nodes)}); expected one "
                          "EPContext node")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    if attrs.get("embed_mode") != 0:
        raise BinaryError(f"{wrapper.name}: embed_mode {attrs.get('embed_mode')}; expected 0 (a context binary beside it)")
    binary, name = wrapper.parent / attrs["ep_cache_context"].decode(), attrs["partition_name"].decode()
    info = binary_info(binary)
    graph = next((g for g in info["graphs"] if g["name"] == name), None)
    if graph is None:
        raise BinaryError(f"{wrapper.name}: names graph {name}, which {binary.name} does not hold (it holds "
                          f"{len(info['graphs'])}); expected the graph it was compiled with")
    model = onnx.load(source, load_external_data=False).graph
    for side, qnn_io, source_io in (("inputs", graph["inputs"], model.input), ("outputs", graph["outputs"], model.output)):
        if differs := _difference(qnn_io, _onnx_signature(source_io)):
            raise BinaryError(f"{wrapper.name}: graph {name}'s {side} are not {source.name}'s ({differs}); expected the "
                              "graph compiled from it")
    return graph | {"binary": binary.name, "build": info["build"], "soc_model": info["soc_model"]}


def differences(shipped: dict, alone: dict) -> list[str]:
    """What the binary metadata of a shipped graph (check_wrapper's answer) says differs from that of the graph
    compiled alone from the same source (`alone`, likewise): the QNN build, the SoC, each input and output's name,
    dtype (fixed-point encodings included) and shape. Graph names are left out: onnxruntime-qnn derives them from
    the source's path."""
    found = [f"{key} {shipped[key]} against {alone[key]}" for key in ("build", "soc_model") if shipped[key] != alone[key]]
    return found + [f"{side} {_signature(shipped[side])} against {_signature(alone[side])}"
                    for side in ("inputs", "outputs") if _signature(shipped[side]) != _signature(alone[side])]
