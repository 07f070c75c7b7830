"""Eager models -> static prefill/decode ONNX graphs and manifest.json."""
from .exporter import ParityError, export_model

__all__ = ["export_model", "ParityError"]
