"""Test helper: the tiny random Llama builder (kept in the package, where the
benchmarks use it too)."""
from loadtest.tiny_model import TINY_DEFAULTS, build_tiny_llama

__all__ = ["TINY_DEFAULTS", "build_tiny_llama"]
