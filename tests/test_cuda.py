"""CUDA: the same parity checks through onnxruntime's CUDAExecutionProvider, cache kept on the GPU."""
import pytest

from runtime import cuda_available, open_generator, open_step
from runtime.parity import reference_model, sequence_parity, step_case, step_parity, within

pytestmark = pytest.mark.skipif(not cuda_available(),
                                reason="this onnxruntime offers no CUDAExecutionProvider (CPU-only build or no GPU)")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_step_parity_on_cuda(exported, dtype):
    art = exported(dtype=dtype)
    for step, t in (("prefill", art.config.chunk), ("decode", 1)):
        session = open_step(art.folder, step, provider="cuda")
        assert session.on_cuda
        err = step_parity(step_case(reference_model(art.model()), art.config, t, p0=art.config.capacity - t), session,
                          art.config)
        assert within(err, dtype), err


@pytest.mark.parametrize("kind", ["attention", "block"])
def test_sequence_parity_on_cuda_with_device_cache(exported, kind):
    art = exported(kind)
    gen = open_generator(art.folder, provider="cuda")
    assert gen._past[0].device_name().lower() == "cuda"
    res = sequence_parity(art.model(), gen, art.config, prompt_len=art.config.chunk + 5, decode_steps=16)
    assert within(res, "fp32"), res
