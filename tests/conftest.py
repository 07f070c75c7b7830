"""Shared fixtures: tiny exports made once per session and reused across tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from export import export_model
from models import AttentionConfig, build_model, preset
from runtime import open_generator, open_step


def prepacks(options) -> bool:
    """Whether onnxruntime pre-packs weights under these SessionOptions (the key unset means its default: on)."""
    try:
        return options.get_session_config_entry("session.disable_prepacking") != "1"
    except RuntimeError:
        return True


@dataclass
class Artifact:
    folder: Path
    config: AttentionConfig
    kind: str
    manifest: dict

    def model(self):
        return build_model(self.config, self.kind, seed=0)

    def session(self, step, target="raw", **options):
        return open_step(self.folder, step, target, provider="cpu", **options)

    def generator(self, target="raw", **options):
        return open_generator(self.folder, target, provider="cpu", **options)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(kind="attention", windows=(), **config_overrides) -> Artifact of the tiny preset, exported once."""
    cache = {}

    def get(kind: str = "attention", windows: tuple[int, ...] = (), **overrides) -> Artifact:
        key = (kind, windows, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp("export")
            config = preset("tiny", **overrides)
            manifest = export_model(config, folder, kind=kind, windows=windows, log=lambda *_: None)
            cache[key] = Artifact(folder, config, kind, manifest)
        return cache[key]

    return get


def pytest_terminal_summary(terminalreporter):
    """Print each test's recorded `summary` property (the fuzz's outcomes and skips by reason) at the end of the run,
    where CI's output shows it, also under xdist (whose workers send the properties with their reports)."""
    for report in (r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])):
        for name, value in getattr(report, "user_properties", []):
            if name == "summary" and report.when == "call":
                terminalreporter.write_line(f"{report.nodeid}:\n{value}")
