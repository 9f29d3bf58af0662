"""Compatibility names: the quantised layers now live in ``pagedbackend.quant``
(one module per scheme). Kept for importers outside the package
(``loadtest.bench``); new code imports ``pagedbackend.quant``."""
from pagedbackend.quant.int4 import INT4_GROUP_SIZES, Int4Linear, dequantize_int4, quantize_int4  # noqa: F401
from pagedbackend.quant.int8 import INT8_KERNEL_MAX_ROWS, Int8Linear, quantize_int8  # noqa: F401
from pagedbackend.quant.policy import QUANTIZATION_MODES  # noqa: F401
from pagedbackend.quant.w8a8 import W8A8Linear, quantize_rows_int8  # noqa: F401
