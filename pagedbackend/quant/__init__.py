"""Quantisation and linear backends: how a loaded model's linear layers multiply.

``policy.apply`` is the one decision; each scheme has its module (``int8``,
``int4``, ``w8a8`` with ``smooth``). The float32 packed layer, its operators
and the native-operator state (``NativeOps``) are in ``kernels.packed_linear``;
the C libraries are built, loaded and checked by ``kernels.native``.

Layer: above ``models`` (it replaces the matmuls of a model's layers), below
``worker`` (the runner calls ``apply`` once, at load); ``models`` never
imports it.
"""
from pagedbackend.config import QUANTIZATION_MODES
from pagedbackend.quant.policy import LinearPlan, apply
from pagedbackend.quant.smooth import Calibration

__all__ = ["Calibration", "LinearPlan", "QUANTIZATION_MODES", "apply"]
