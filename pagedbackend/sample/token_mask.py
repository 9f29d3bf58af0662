"""Structured outputs' token masks applied to the logits: each constrained
row keeps the tokens its grammar's matcher allows (``pagedbackend.structured``
fills the masks; the sampler applies them here)."""
import ctypes

import torch


def mask_logits(logits: torch.Tensor, rows) -> None:
    """Mask, in place, every row of ``logits`` that a constrained ``SampleRow``
    names to the tokens its matcher allows (rows sharing a logits row share
    its matcher: the candidates of one prompt before they fork). On CPU
    float32 logits through ``kernels/csrc/token_mask.c`` (xgrammar's CPU
    kernel took 2-4 ms for 32 rows of the default model's vocabulary, the C
    one a fraction of that: ``loadtest.bench structured``), else xgrammar's."""
    matchers = {}
    for r in rows:
        if r.constraint is not None:
            matchers.setdefault(r.row, r.constraint)
    if not matchers:
        return
    words = (logits.shape[1] + 31) // 32
    kernel = _mask_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is not None and logits.stride(1) == 1:
        bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
        for i, matcher in enumerate(matchers.values()):
            matcher.fill_next_token_bitmask(bitmask, i)
        targets = torch.tensor(list(matchers), dtype=torch.long)
        kernel(ctypes.c_void_p(logits.data_ptr()), logits.stride(0), ctypes.c_void_p(bitmask.data_ptr()), words,
               ctypes.c_void_p(targets.data_ptr()), len(matchers), logits.shape[1])
        return
    import xgrammar as xgr
    bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32)
    for row, matcher in matchers.items():
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=list(matchers))


_kernel_state = {}


def _mask_kernel():
    """The C function of ``token_mask.c``, or None where it cannot be built
    (xgrammar's kernel serves then)."""
    if "kernel" not in _kernel_state:
        from pagedbackend.kernels import native
        try:
            kernel = native.load("token_mask").apply_token_mask
        except RuntimeError:
            kernel = None
        _kernel_state["kernel"] = kernel
    return _kernel_state["kernel"]
