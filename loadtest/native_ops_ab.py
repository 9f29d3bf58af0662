"""Two variants of the compiled decode step, paired in one process: one decode
step of ``--rows`` sequences (contexts of 60, 100, 140, ... tokens), the two
variants alternating step by step so that a noisy host weighs on both alike.

- ``--compare ops`` (default): the packed layers' operators with Python
  kernels against those with C++ kernels (one model, two graphs);
- ``--compare guards``: a step that checks dynamo's guards on the model's
  modules before every call against one that does not (the default; two
  models, one compiled step each).
- ``--compare kv_write``: the step's K/V stored by ``index_copy_`` whenever V
  is not contiguous (a slice of the QKV output, so always) against the C
  ``paged_write``, which takes its rows where they lie (the default).
- ``--compare decode_step``: every layer's attention through the general
  path (``sdpa_forward``: its checks, then the C kernels) against the step's
  own function, checked once per step (``sdpa_attention.decode_step``, the
  default).
- ``--compare w8a8_kernel``: ``quantization=w8a8`` with every matmul through
  ``torch._int_mm`` against steps of up to 16 rows through the VNNI kernel
  (``kernels/csrc/w8a8_gemm.c``, the default where the CPU has AVX-512 VNNI).
- ``--compare gguf_ops``: a GGUF model's (``--model FILE.gguf``, with
  ``--quantization w8a8`` its int8-activation products) layers through the
  operators with Python kernels against the C++ ones (``csrc/gguf_ops.cpp``;
  two models, one compiled step each).

    python -m loadtest.native_ops_ab --rows 5 --steps 60 [--compare guards]
"""
import argparse
import functools
import statistics
import time

import torch

VARIANTS = {"ops": ("Python kernels", "C++ kernels"),
            "guards": ("module guards checked", "module guards dropped"),
            "kv_write": ("KV write by index_copy_", "KV write by the C kernel"),
            "decode_step": ("attention by the general path", "attention by the step's function"),
            "w8a8_kernel": ("w8a8 by torch._int_mm", "w8a8 by the VNNI kernel"),
            "gguf_ops": ("GGUF layers' Python kernels", "GGUF layers' C++ kernels")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.native_ops_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="ops")
    ap.add_argument("--quantization", default="none", help="the engine's quantization (gguf_ops: none or w8a8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pagedbackend.config import EngineConfig
    from pagedbackend.kernels import packed_linear
    from pagedbackend.worker import model_runner, step_source
    from pagedbackend.worker.batch import SeqEntry
    from pagedbackend.worker.compiled import CompiledStep

    def make_runner(quantization="none", **compiled_options):
        if compiled_options:
            step_source.CompiledStep = functools.partial(CompiledStep, **compiled_options)
        try:
            return model_runner.ModelRunner(EngineConfig(model=args.model, device="cpu", num_kv_blocks=400,
                                                         quantization=quantization))
        finally:
            step_source.CompiledStep = CompiledStep

    if args.compare == "ops":
        runner = make_runner()
        if not packed_linear.native_ops().use_native_ops:
            raise SystemExit(f"the C++ operators are not in use: {packed_linear.native_ops().native_ops_failure}")

        def variant(second: bool):
            packed_linear.native_ops().use_native_ops = second
            return runner
    elif args.compare == "guards":
        runners = {False: make_runner(guard_model=True), True: make_runner(guard_model=False)}
        variant = runners.__getitem__
    elif args.compare == "gguf_ops":
        from pagedbackend.models import gguf_linear
        gguf_linear._native = False   # the layers of the first runner are given the Python operators
        runners = {False: make_runner(args.quantization)}
        gguf_linear._native = None
        runners[True] = make_runner(args.quantization)
        natives = {k: {m.native for m in r.model.modules() if isinstance(m, gguf_linear.GGUFLinear)}
                   for k, r in runners.items()}
        if natives != {False: {False}, True: {True}}:
            raise SystemExit("--compare gguf_ops needs a GGUF model whose layers build the C++ operators")
        variant = runners.__getitem__
    elif args.compare == "w8a8_kernel":
        runner = make_runner(quantization="w8a8")
        if packed_linear.set_w8a8_kernel_rows(packed_linear.W8A8_KERNEL_MAX_ROWS) == 0:
            raise SystemExit(f"the w8a8 VNNI kernel is not in use: {packed_linear.native_ops().w8a8_kernel_failure}")

        def variant(second: bool):
            packed_linear.set_w8a8_kernel_rows(packed_linear.W8A8_KERNEL_MAX_ROWS if second else 0)
            return runner
    elif args.compare == "decode_step":
        from pagedbackend.kernels import sdpa_attention
        runner = make_runner()

        def variant(second: bool):
            sdpa_attention.USE_DECODE_STEP = second
            return runner
    else:
        from pagedbackend.kernels import sdpa_attention
        runner, rows_contiguous = make_runner(), sdpa_attention._rows_contiguous

        def variant(second: bool):
            sdpa_attention._rows_contiguous = rows_contiguous if second else torch.Tensor.is_contiguous
            return runner
    entries, next_block = [], 1
    for length in (60 + 40 * i for i in range(args.rows)):
        blocks = -(-(length + 1) // 16)
        entries.append(SeqEntry([100 + length], length, list(range(next_block, next_block + blocks))))
        next_block += blocks
    times = {False: [], True: []}
    for second in (False, True):   # compile and warm both
        for _ in range(3):
            variant(second).execute_model(entries)
    for i in range(args.steps):
        for second in ((False, True) if i % 2 else (True, False)):
            runner = variant(second)
            start = time.perf_counter()
            runner.execute_model(entries)
            times[second].append(1000 * (time.perf_counter() - start))
    first_name, second_name = VARIANTS[args.compare]
    for second, name in ((False, first_name), (True, second_name)):
        print(f"{name}: median step {statistics.median(times[second]):.2f} ms, min {min(times[second]):.2f} ms")
    diff = statistics.median(b - a for a, b in zip(times[False], times[True]))
    ratio = statistics.median(b / a for a, b in zip(times[False], times[True]))
    print(f"paired difference ({second_name} - {first_name}), median: {diff:.2f} ms; "
          f"ratio, median: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
