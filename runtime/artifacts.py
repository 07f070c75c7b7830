"""Open an export folder (graphs + manifest.json) for running: what a user of `artifacts/` calls."""
from __future__ import annotations

import json
from pathlib import Path

import registry

from .drivers import Driver, Generator, HostCacheGenerator
from .session import StepSession
from .shared_weights import SharedWeights

# Above this many bytes in the weights file, even a target over one window (two sessions) reads one mapping of it
# (runtime/shared_weights.py), its decode session alone pre-packing a copy: a 0.6B model's prefill and decode sessions
# would otherwise hold two pre-packed copies. Below it each of the two pre-packs its own, since a pre-packed prefill
# chunk runs faster. A ladder's sessions always share one mapping.
SHARE_ABOVE = 2 << 30


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


def windows(manifest: dict, target: str | None = None) -> list[int]:
    """The window ladder of the export (or of one target's graphs), ascending: the capacity alone for an export
    without a ladder."""
    return sorted({g["window"] for g in manifest.get("graphs", [])
                   if "window" in g and g["target"] == (target or g["target"])}) or [manifest["config"]["capacity"]]


def graph_entry(manifest: dict, step: str, target: str | None = None, window: int | None = None) -> dict:
    """The step's graph for `target` (default: the registry's root, raw) over `window` cache rows (default: the
    capacity)."""
    target = target or registry.root()
    window = window or windows(manifest, target)[-1]
    for g in manifest.get("graphs", []):
        if g["step"] == step and g["target"] == target and g.get("window", window) == window:
            return g
    have = sorted(f"{g['step']}/{g['target']}" + (f"@{g['window']}" if "window" in g else "")
                  for g in manifest.get("graphs", []))
    raise ArtifactError(f"no {step} graph for target {target!r} over {window} rows in the manifest; "
                        f"expected one of {have}")


def open_step(folder: str | Path, step: str, target: str | None = None, window: int | None = None,
              manifest: dict | None = None, **session_options) -> StepSession:
    """A session for one graph, its feeds checked against the manifest's I/O specs (`manifest`: the folder's)."""
    g = graph_entry(manifest or load_manifest(folder), step, target, window)
    return StepSession(Path(folder) / g["file"], g["inputs"], g["outputs"],
                       cache_in_place=g.get("cache_in_place", False), **session_options)


def reads_live_rows_only(manifest: dict, target: str) -> bool:
    """Every attention of the target's graphs is GroupQueryAttention (passes/lower_gqa.py lowered all of them), which
    reads only the cache rows in use: over a larger window a step costs it nothing more (SmolLM2 decode@128 over 256
    rows 22.03 ms, over 2048 22.45), so a ladder only multiplies its sessions."""
    def lowered(g: dict) -> bool:
        stats = next((p["stats"] for p in g.get("passes", []) if p["pass"] == "lower_gqa"), {})
        return stats.get("fused", 0) > 0 and stats.get("unfused", 0) == 0
    graphs = [g for g in manifest.get("graphs", []) if g["target"] == target]
    return bool(graphs) and all(lowered(g) for g in graphs)


def open_generator(folder: str | Path, target: str | None = None, ladder: bool = True, manifest: dict | None = None,
                   **session_options) -> Driver:
    """A generation driver (host-cache for `npu`) over one target's prefill and decode graphs, every session open and
    every decode session run once (Driver.warm) before it returns: over the export's window ladder, or with
    `ladder=False` over the capacity's graphs alone.
    `manifest`: the folder's, unless given (an export checking what it just wrote).

    A target whose attention reads only the rows in use runs over the capacity's graphs alone: a ladder would only
    multiply its sessions. A ladder's sessions read the weights through one mapping (SharedWeights, unless `weights`
    says otherwise), so its windows hold one copy, not one per session; so do two sessions over more than
    SHARE_ABOVE bytes, the decode session pre-packing its own."""
    manifest, target = manifest or load_manifest(folder), target or registry.root()
    sizes = windows(manifest, target)
    if not ladder or reads_live_rows_only(manifest, target):
        sizes = sizes[-1:]
    large = manifest.get("weights", {}).get("bytes", 0) > SHARE_ABOVE
    if len(sizes) > 1 or large:
        session_options.setdefault("weights", SharedWeights())
    prepack = len(sizes) == 1  # one decode session: its one pre-packed copy is what makes decode fast
    sessions = {w: tuple(open_step(folder, step, target, w, manifest, prepack=prepack and step == "decode",
                                   **session_options) for step in registry.STEPS) for w in sizes}
    first, larger = sessions.pop(sizes[0]), sessions
    host = graph_entry(manifest, "decode", target).get("host_cache")
    driver = HostCacheGenerator(*first, host["mask_value"], larger) if host else Generator(*first, larger)
    driver.warm()
    return driver
