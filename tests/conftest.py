"""Shared test setup."""
import os

import torch

# Triton-lang kernels run on CPU tensors through the interpreter when no GPU is
# present; it must be switched on before `triton` is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
