"""Graph passes: one pipeline per target (registry.py), each pass one file and one job."""
from .pipeline import TARGETS, passes_for, run_pipeline

__all__ = ["TARGETS", "passes_for", "run_pipeline"]
