"""Open an export folder (graphs + manifest.json) for running: what a user of `artifacts/` calls."""
from __future__ import annotations

import json
from pathlib import Path

from .drivers import Driver, Generator, HostCacheGenerator
from .session import StepSession


class ArtifactError(ValueError):
    """An export folder without a readable manifest, or without the graph asked for."""


def load_manifest(folder: str | Path) -> dict:
    path = Path(folder) / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: not found; expected an export folder written by `python -m export`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); expected the manifest written by `python -m export`") from None


def graph_entry(manifest: dict, step: str, target: str = "raw") -> dict:
    for g in manifest.get("graphs", []):
        if g["step"] == step and g["target"] == target:
            return g
    have = sorted(f"{g['step']}/{g['target']}" for g in manifest.get("graphs", []))
    raise ArtifactError(f"no {step} graph for target {target!r} in the manifest; expected one of {have}")


def open_step(folder: str | Path, step: str, target: str = "raw", **session_options) -> StepSession:
    """A session for one graph, its feeds checked against the manifest's I/O specs."""
    g = graph_entry(load_manifest(folder), step, target)
    return StepSession(Path(folder) / g["file"], g["inputs"], g["outputs"],
                       cache_in_place=g.get("cache_in_place", False), **session_options)


def open_generator(folder: str | Path, target: str = "raw", **session_options) -> Driver:
    """Prefill and decode sessions of one target behind a generation driver (host-cache for `npu`)."""
    sessions = [open_step(folder, step, target, **session_options) for step in ("prefill", "decode")]
    host = graph_entry(load_manifest(folder), "decode", target).get("host_cache")
    return HostCacheGenerator(*sessions, host["mask_value"]) if host else Generator(*sessions)
