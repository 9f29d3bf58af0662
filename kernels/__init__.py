"""Triton-lang kernels for the paged KV cache, each with a torch reference twin."""
import os

import torch

# Without a GPU the Triton-lang kernels run through the interpreter, which must
# be chosen before `triton` is imported anywhere in the process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
