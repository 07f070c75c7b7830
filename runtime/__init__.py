"""onnxruntime sessions over exported graphs: checked feeds, runtime-owned cache, parity against eager."""
from .artifacts import ArtifactError, load_manifest, open_generator, open_step
from .drivers import Generator
from .session import FeedError, StepSession, cuda_available

__all__ = ["ArtifactError", "FeedError", "Generator", "StepSession", "cuda_available", "load_manifest",
           "open_generator", "open_step"]
