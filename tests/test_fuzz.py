"""Fuzzing the passes: mutated real graphs never hang or escape as a traceback, and whatever
`python -m passes` writes is a valid model that runs in onnxruntime and computes what its input computed.

FUZZ_CASES sets the number of cases (CI: 300; `make fuzz`: 2000).
"""
import os
import signal

import numpy as np
import onnx
import pytest

from passes.__main__ import main
from passes.model_io import check
from passes.verify import VerifyError, compare, run_check

CASES = int(os.environ.get("FUZZ_CASES", "300"))
TARGETS = ("raw", "onnx", "ort", "npu")


def mutate(model: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, bytes]:
    """One random mutation of a copy of `model`: (what was done, the bytes to feed the passes)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    nodes, kind = m.graph.node, rng.integers(6)
    i = int(rng.integers(len(nodes)))
    if kind == 0:
        what = f"drop node {nodes[i].op_type}"
        del nodes[i]
    elif kind == 1:
        names = [o for n in nodes for o in n.output] + [v.name for v in m.graph.input]
        j = int(rng.integers(len(nodes[i].input))) if nodes[i].input else 0
        what = f"rewire {nodes[i].op_type} input {j}"
        if nodes[i].input:
            nodes[i].input[j] = names[int(rng.integers(len(names)))]
    elif kind == 2:
        with_attrs = [n for n in nodes if n.attribute] or list(nodes)
        node = with_attrs[int(rng.integers(len(with_attrs)))]
        what = f"change an attribute of {node.op_type}"
        for a in node.attribute:
            if a.type == onnx.AttributeProto.INT:
                a.i = int(rng.integers(-3, 4))
            elif a.type == onnx.AttributeProto.INTS and len(a.ints):
                a.ints[:] = list(rng.permutation(list(a.ints)))
    elif kind == 3:
        ints = [t for t in m.graph.initializer if t.data_type == onnx.TensorProto.INT64 and 0 < np.prod(t.dims) <= 8]
        what = "change a shape constant"
        if ints:
            t = ints[int(rng.integers(len(ints)))]
            array = onnx.numpy_helper.to_array(t).copy()
            array.reshape(-1)[int(rng.integers(array.size))] = int(rng.integers(-1, 5))
            t.CopyFrom(onnx.numpy_helper.from_array(array, t.name))
    elif kind == 4:
        dims = m.graph.input[int(rng.integers(len(m.graph.input)))].type.tensor_type.shape.dim
        what = "change an input dim"
        dims[int(rng.integers(len(dims)))].dim_value = int(rng.integers(1, 5))
    else:
        data = model.SerializeToString()
        return "truncate", data[: int(rng.integers(1, len(data)))]
    return what, m.SerializeToString()


@pytest.fixture(scope="module")
def seeds(exported):
    art, block = exported(), exported("block")
    return [onnx.load(str(a.folder / f"{s}.raw.onnx")) for a in (art, block) for s in ("prefill", "decode")]


def _alarm(*_):
    raise TimeoutError("a fuzz case ran past 120 s")


def test_fuzz_the_passes(seeds, tmp_path, capsys):
    rng = np.random.default_rng(0)
    signal.signal(signal.SIGALRM, _alarm)
    written = checked = 0
    for case in range(CASES):
        what, data = mutate(seeds[case % len(seeds)], rng)
        target = TARGETS[case % len(TARGETS)]
        src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
        src.write_bytes(data)
        out.unlink(missing_ok=True)
        signal.alarm(120)
        try:
            status = main([str(src), str(out), "--target", target])
        finally:
            signal.alarm(0)
        err = capsys.readouterr().err
        assert status in (0, 1), (case, what, status)
        assert "Traceback" not in err and (status == 0 or err.startswith("error: ")), (case, what, err)
        assert src.read_bytes() == data  # the input is never modified
        if status != 0:
            assert not out.exists()
            continue
        written += 1
        check(onnx.load(str(out)))
        assert run_check(str(out), str(src)) is None, (case, what, target)
        if target == "npu":
            continue  # another interface: its numerics are checked against eager PyTorch elsewhere
        try:
            results = compare(str(src), str(out))
        except VerifyError:
            continue  # the mutated input does not run: nothing to compare against
        checked += 1
        bad = {k: r for k, r in results.items() if not r["ok"] and np.isfinite(r["max_abs"])}
        assert not bad, (case, what, target, bad)
    print(f"{CASES} cases: {written} rewritten, {checked} compared with their input in onnxruntime")
    assert written and checked
