"""A window ladder traced once per step (the cache rows one symbol, pinned per window by fix_dims), and every target's
passes run as one tree (run_pipelines: each prefix the targets share run once): the same graphs as a trace per window
and a pipeline per target, and a pin that does not make the window's graph is refused by the export's checks."""
import pytest

from export import exporter, torch_export
from export.exporter import ParityError
from models import build_model, preset
from models.contract import step_len
from runtime.session import ContractError
from passes.pipeline import TARGETS, lineage, run_pipeline, run_pipelines

LADDER = (16, 32, 64)
PAIR = (32, 64)  # the fallbacks trace per window: two windows show it


def _counting(monkeypatch) -> list:
    """exporter.to_onnx, recording whether each call traced any window (True) or one (False)."""
    calls, real = [], exporter.to_onnx

    def counted(*args, any_window=False, **kwargs):
        calls.append(any_window)
        return real(*args, any_window=any_window, **kwargs)
    monkeypatch.setattr(exporter, "to_onnx", counted)
    return calls


def test_a_ladder_is_traced_once_per_step(tmp_path, monkeypatch):
    calls, lines = _counting(monkeypatch), []
    manifest = exporter.export_model(preset("tiny"), tmp_path / "out", kind="lm", targets=("raw", "ort"),
                                     windows=LADDER, log=lines.append)
    assert calls == [True, True]  # prefill, decode
    assert not [line for line in lines if "traced once per window" in line]
    assert sorted({g["window"] for g in manifest["graphs"]}) == list(LADDER)  # each checked against eager on publish


def test_a_trace_that_fixes_the_rows_falls_back_to_a_trace_per_window(tmp_path, monkeypatch):
    """Planted: torch.export made the cache rows a number. The ladder is then traced per window, and says why."""
    calls, lines = _counting(monkeypatch), []
    monkeypatch.setattr(exporter, "cache_rows", lambda graph: None)
    exporter.export_model(preset("tiny"), tmp_path / "out", targets=("onnx",), windows=PAIR, log=lines.append)
    assert calls == [True, False, False] * 2
    assert [line for line in lines if "traced once per window" in line] == [
        f"{step}: traced once per window, not once for the ladder (torch.export made the cache rows a number)"
        for step in ("prefill", "decode")]


def test_a_symbolic_trace_that_fails_falls_back(tmp_path, monkeypatch):
    real, lines = torch_export.export_module, []

    def refuses_symbols(*args, **kwargs):
        if kwargs.get("dynamic_shapes") or (len(args) > 5 and args[5] is not None):
            raise RuntimeError("Constraints violated (cache_rows)")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch_export, "export_module", refuses_symbols)
    exporter.export_model(preset("tiny"), tmp_path / "out", targets=("raw",), windows=PAIR, log=lines.append)
    assert "prefill: traced once per window, not once for the ladder (RuntimeError: Constraints violated " \
           "(cache_rows))" in lines


def test_a_window_pinned_to_the_wrong_rows_is_refused(tmp_path, monkeypatch):
    """Planted: every window's graph pinned to the capacity's rows. The export refuses it and writes nothing."""
    real = exporter.run_pipelines
    monkeypatch.setattr(exporter, "run_pipelines",
                        lambda graph, targets, pins=None: real(graph, targets, {k: 64 for k in (pins or {})}))
    with pytest.raises(ContractError, match=r"^prefill\.raw\.w16\.onnx: input past_key is declared \[1, 2, 64, 16\]; "
                                            r"the step's contract expects \[1, 2, 16, 16\]$"):
        exporter.export_model(preset("tiny"), tmp_path / "out", targets=("raw",), windows=LADDER,
                              log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def _ops(model) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in model.graph]


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_run_pipelines_makes_what_run_pipeline_makes(step):
    config = preset("tiny")
    model = build_model(config, "lm", seed=0)
    traced = torch_export.to_onnx(model, config, step_len(config, step), kind="lm", any_window=True)
    pins = {torch_export.cache_rows(traced): 32}
    targets = [*TARGETS, "ort-int4"]
    before = _ops(traced)
    shared = run_pipelines(traced, targets, pins)
    assert _ops(traced) == before  # the traced graph is left as it was: the next window starts from it
    for target in targets:
        alone = traced.clone()
        report = run_pipeline(alone, target, fix_dims=pins)
        graph, shared_report = shared[target]
        assert _ops(graph) == _ops(alone), target
        assert [(p["pass"], p["stats"]) for p in shared_report["passes"]] == \
            [(p["pass"], p["stats"]) for p in report["passes"]], target
        assert next(v for v in graph.graph.inputs if v.name.startswith("past_")).shape[2] == 32


def test_lineage_names_each_targets_parents():
    assert lineage("npu") == ["raw", "onnx", "npu"]
    assert lineage("ort-int4") == ["raw", "ort", "ort-int4"]
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        lineage("tpu")
