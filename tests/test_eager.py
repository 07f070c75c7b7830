"""The export's eager references on disk: a case built from the spilled prefix is the case built from the model."""
import pytest
import torch

from export.eager import EagerReferences
from models import build_model, preset
from runtime.parity import prefix_caches, reference_model, step_case


@pytest.mark.parametrize("kind", ["attention", "lm"])
def test_spilled_prefix_gives_the_models_case(tmp_path, kind):
    config = preset("tiny")
    reference = reference_model(build_model(config, kind))
    eager = EagerReferences(tmp_path / "eager")
    eager.keep_prefix(prefix_caches(reference, config, config.capacity, seed=3, kind=kind))
    first = next(eager.prefix())
    assert first.is_contiguous() and first.shape[2] == config.capacity  # a file holds its cache's rows, nothing more
    p0 = config.capacity - config.chunk
    spilled = step_case(reference, config, config.chunk, p0, seed=3, kind=kind, prefix=eager.prefix)
    direct = step_case(reference, config, config.chunk, p0, seed=3, kind=kind)
    for got, want in zip(spilled.args + spilled.ref, direct.args + direct.ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    eager.close()
    assert not (tmp_path / "eager").exists()


def test_a_prefix_missing_a_cache_is_refused(tmp_path):
    """Planted: one cache's file fewer than the step has caches must fail, not leave that cache's rows random."""
    config = preset("tiny")
    reference = reference_model(build_model(config, "lm"))
    eager = EagerReferences(tmp_path / "eager")
    eager.keep_prefix(prefix_caches(reference, config, config.capacity, kind="lm")[:-1])
    with pytest.raises(ValueError):
        step_case(reference, config, config.chunk, 4, kind="lm", prefix=eager.prefix)
