"""``python -m loadtest.bench kv_cache_dtype``: the kernel part at quick size,
with another revision's kernel interleaved, and the capacity part."""
import json

import pytest

from loadtest.bench import kv_cache_dtype
from pagedbackend.kernels import sdpa_attention as sa

pytestmark = pytest.mark.skipif(sa.native_decode() is None, reason="no C compiler here for the decode kernel")


def test_the_kernel_part_times_every_dtype_beside_a_revisions_kernel(tmp_path):
    result = kv_cache_dtype.main(["--parts", "kernel,capacity", "--quick", "--threads", "1", "--against", "HEAD",
                                  "--out", str(tmp_path)])
    assert json.loads((tmp_path / "kv_cache_dtype.json").read_text())["kernel"] == result["kernel"]
    (row,) = result["kernel"]
    assert (row["context"], row["seqs"], row["layers"]) == (512, 2, 2)
    for name in kv_cache_dtype.DTYPES:
        assert row[f"{name}_ms"] > 0 and row[f"{name}_x_rev"] > 0   # HEAD's kernel, checked equal, timed beside
    assert row["float32_speedup"] == 1.0 and row["float32_max_abs_error"] == 0
    assert 0 < row["int8_max_abs_error"] < 0.05
    cap = result["capacity_tokens_256mib"]
    assert cap["int8"] > cap["bfloat16"] > cap["float32"] and cap["fp8_e4m3"] == cap["fp8_e5m2"]


def test_a_revision_that_is_not_there_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="--against no-such-rev"):
        kv_cache_dtype.main(["--parts", "kernel", "--quick", "--threads", "1", "--against", "no-such-rev",
                             "--out", str(tmp_path)])
