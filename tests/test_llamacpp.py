"""benchmarks/llamacpp.py without building llama-cpp-python: fake converter and quantizer stand for llama.cpp's.

Each gate gets a planted fault: changed weights (by the safetensors' hash, or by FETCHED.json) rebuild every GGUF;
a converter that fails halfway leaves no file a later run would reuse, and a later run builds it; weights that
change back after an interrupted rebuild are not matched to files of the other weights; a folder without its
original GGUF, an sdist with another sha256, a failed pip install are one-line errors. The driver tests need
llama_cpp itself and skip without it: a one-layer GGUF's logits through feed/decode and the decode timing's
rewind agree with a single read of the whole sequence, and with transformers on the same GGUF.
"""
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import llamacpp as L


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A fake Hugging Face folder and a converter/quantizer that record their calls; the fake GGUFs hold text naming
    the weights they were made from."""
    folder, out, calls = tmp_path / "hf", tmp_path / "out", []
    folder.mkdir()
    (folder / "model.safetensors").write_text("weights-1")
    (folder / "original.Q4_1.gguf").write_text("q4_1")

    def convert(src, dest, cache, log):
        calls.append("convert")
        dest.write_text("f32 of " + (src / "model.safetensors").read_text())

    def quantize(src, dest, log):
        calls.append("quantize")
        dest.write_text("q4_0 of " + src.read_text())
    monkeypatch.setattr(L, "convert", convert)
    monkeypatch.setattr(L, "quantize", quantize)
    return folder, out, calls


def build(folder, out):
    return L.build_ggufs(folder, out, log=lambda *_: None)


def contents(files):
    return {engine: path.read_text() for engine, path in files.items()}


def test_built_once_then_reused(built):
    folder, out, calls = built
    files = build(folder, out)
    assert contents(files) == {"llamacpp-f32": "f32 of weights-1", "llamacpp-q4_0": "q4_0 of f32 of weights-1",
                               "llamacpp-q4_1": "q4_1"}
    assert files["llamacpp-q4_1"] == folder / "original.Q4_1.gguf" and calls == ["convert", "quantize"]
    assert build(folder, out) == files and calls == ["convert", "quantize"]
    assert sorted(p.name for p in out.iterdir()) == ["built-from-weights", "llamacpp-f32.gguf", "llamacpp-q4_0.gguf"]


def test_changed_weights_rebuild_everything(built):
    folder, out, calls = built
    build(folder, out)
    (folder / "model.safetensors").write_text("weights-2")
    assert contents(build(folder, out))["llamacpp-q4_0"] == "q4_0 of f32 of weights-2"
    assert calls == ["convert", "quantize"] * 2
    # a fetch record pins the weights: it is the stamp, and a new one rebuilds
    (folder / "FETCHED.json").write_text('{"sha256": "a"}')
    build(folder, out)
    (folder / "FETCHED.json").write_text('{"sha256": "b"}')
    build(folder, out)
    assert calls == ["convert", "quantize"] * 4


def test_failed_conversion_leaves_nothing_to_reuse(built, monkeypatch):
    folder, out, calls = built

    def halfway(src, dest, cache, log):
        dest.write_text("f32, the first hal")
        raise RuntimeError("convert_hf_to_gguf.py failed: killed")
    real = L.convert
    monkeypatch.setattr(L, "convert", halfway)
    with pytest.raises(RuntimeError, match="killed"):
        build(folder, out)
    assert [p.name for p in out.iterdir()] == ["built-from-weights"]
    monkeypatch.setattr(L, "convert", real)
    assert contents(build(folder, out))["llamacpp-f32"] == "f32 of weights-1" and calls == ["convert", "quantize"]


def test_failed_quantize_keeps_the_f32_file(built, monkeypatch):
    folder, out, calls = built
    real = L.quantize
    monkeypatch.setattr(L, "quantize", lambda src, dest, log: (dest.write_text("q4"), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        build(folder, out)
    assert sorted(p.name for p in out.iterdir()) == ["built-from-weights", "llamacpp-f32.gguf"]
    monkeypatch.setattr(L, "quantize", real)
    assert contents(build(folder, out))["llamacpp-q4_0"] == "q4_0 of f32 of weights-1" and calls == ["convert", "quantize"]


def test_weights_changed_back_after_an_interrupted_rebuild(built, monkeypatch):
    """Built from weights-1, then a rebuild for weights-2 fails after its F32 file: weights-1 again must not reuse
    that weights-2 file (the stamp went first, and the old files with it)."""
    folder, out, calls = built
    build(folder, out)
    (folder / "model.safetensors").write_text("weights-2")
    monkeypatch.setattr(L, "quantize", lambda src, dest, log: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build(folder, out)
    assert (out / "llamacpp-f32.gguf").read_text() == "f32 of weights-2" and not (out / "llamacpp-q4_0.gguf").exists()
    (folder / "model.safetensors").write_text("weights-1")
    monkeypatch.undo()
    monkeypatch.setattr(L, "convert", lambda src, dest, cache, log: dest.write_text("f32 again"))
    monkeypatch.setattr(L, "quantize", lambda src, dest, log: dest.write_text("q4_0 again"))
    assert contents(build(folder, out))["llamacpp-f32"] == "f32 again"


def test_folder_without_its_gguf(built):
    folder, out, _ = built
    (folder / "original.Q4_1.gguf").unlink()
    with pytest.raises(FileNotFoundError, match="0 GGUF files; expected one"):
        build(folder, out)
    assert not out.exists()


def fake_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/llama.py",
                     "vendor/llama.cpp/gguf-py/gguf/__init__.py", "vendor/llama.cpp/src/llama.cpp",
                     "vendor/llama.cpp/convert_lora_to_gguf.py", "llama_cpp/llama.py"):
            data = name.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_converter_takes_only_what_it_imports(tmp_path):
    L.extract_converter(fake_sdist(tmp_path / "sdist.tar.gz"), tmp_path / "c")
    got = sorted(str(p.relative_to(tmp_path / "c")) for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert got == ["conversion/llama.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]


def test_sdist_of_another_hash_refused(tmp_path, monkeypatch):
    def pip_download(cmd, **_):
        fake_sdist(Path(cmd[cmd.index("--dest") + 1]) / "llama_cpp_python-0.3.36.tar.gz")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(L.subprocess, "run", pip_download)
    with pytest.raises(L.LlamaCppUnavailable, match="sha256 .*; expected the pinned"):
        L.converter(tmp_path / "converter", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "converter").mkdir()
    (tmp_path / "converter" / "convert_hf_to_gguf.py").write_text("")
    monkeypatch.setattr(L.subprocess, "run", None)  # cached: no pip
    assert L.converter(tmp_path / "converter") == tmp_path / "converter" / "convert_hf_to_gguf.py"


def test_failed_install_is_one_line(monkeypatch):
    said = []
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    monkeypatch.setattr(L.subprocess, "run", lambda cmd, **_: subprocess.CompletedProcess(
        cmd, 1, "", "Building wheel ...\nERROR: Failed to build installable wheels for some pyproject.toml based projects\n"))
    with pytest.raises(L.LlamaCppUnavailable, match=r"^pip install llama-cpp-python==0.3.36 failed: ERROR: Failed to build"):
        L.ensure_installed(log=said.append)
    assert len(said) == 1 and "built from source once" in said[0]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A one-layer llama GGUF (tests/test_fetch.py's)."""
    pytest.importorskip("llama_cpp")
    from tests.test_fetch import tiny_gguf
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    """The tiny GGUF through the driver, in this process: where this llama.cpp build faults on it (the probe test
    below fails then), the driver's tests would take the test worker down with them."""
    if why := L.faults(tiny_path):
        pytest.skip(why)
    return tiny_path, L.LlamaCppDriver(tiny_path, threads=1, n_ctx=64)


def test_driver_cache_and_rewind(tiny):
    _, driver = tiny
    ids = np.random.default_rng(0).integers(3, driver.n_vocab, (1, 12))
    whole = driver.feed(ids)
    assert whole.shape == (1, 1, driver.n_vocab) and whole.dtype == np.float32
    driver.reset()
    driver.feed(ids[:, :5])
    for i in range(5, 12):
        step = driver.decode(ids[:, i:i + 1])
    np.testing.assert_allclose(step, whole, atol=1e-4 * np.abs(whole).max())
    run = driver.decode_runner(ids)
    first, again = run(), run()
    np.testing.assert_array_equal(first, again)
    after = driver.feed(np.concatenate([ids, [[int(np.argmax(whole))]]], axis=1))
    np.testing.assert_allclose(first, after, atol=1e-4 * np.abs(after).max())
    np.testing.assert_array_equal(driver.prefill_runner(ids)(), driver.feed(ids))


def test_driver_logits_are_transformers(tiny):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    path, driver = tiny
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = np.random.default_rng(0).integers(3, driver.n_vocab, (1, 9))
    with torch.inference_mode():
        ref = model(torch.from_numpy(ids)).logits[:, -1:].numpy()
    got = driver.feed(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 5e-2 and got.argmax() == ref.argmax()


def test_a_gguf_llama_cpp_faults_on_is_named_not_fatal(tmp_path, monkeypatch):
    # planted faults: the evaluation killed by a signal (what llama.cpp's AMX kernels did on this VM), exiting with an
    # error, hanging; each is one line naming the file, and this process goes on
    path = tmp_path / "model.gguf"
    monkeypatch.setattr(L, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    why = L.faults(path)
    assert why.startswith("llama.cpp failed to evaluate model.gguf on this CPU (killed by SIGSEGV)") and "\n" not in why
    monkeypatch.setattr(L, "PROBE", "raise SystemExit('unknown model architecture')")
    assert "(exit 1: unknown model architecture)" in L.faults(path)
    monkeypatch.setattr(L, "PROBE", "import time; time.sleep(30)")
    assert L.faults(path, timeout=1) == "llama.cpp did not evaluate model.gguf within 1 s"


def test_a_gguf_llama_cpp_evaluates_passes_the_probe(tiny_path):
    assert L.faults(tiny_path) is None
