"""Builds the compiled step package of one model setting
(``step_package.py`` says what it holds and when it is built): ``python -m
pagedbackend.worker.step_build --settings JSON --threads N``."""
import argparse
import dataclasses
import json
import logging
import os
import pathlib
import sys
import time

import torch

from pagedbackend.config import EngineConfig
from pagedbackend.models.attention import step_context
from pagedbackend.worker import step_package
from pagedbackend.worker.batch import SeqEntry
from pagedbackend.worker.compiled import use_compile_cache
from pagedbackend.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedbackend")


class _Forward(torch.nn.Module):
    """The exported function: the model's forward pass, nothing else."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)


def buffers_as_parameters(module: torch.nn.Module) -> int:
    """Register every tensor buffer of ``module`` as a parameter (no gradient,
    the same storage); returns how many. AOTInductor copies each buffer of an
    exported module, in case the graph writes it (ours write none), and no
    parameter: a model whose weights are buffers (packed, paired, GGUF blocks
    and panels) would be held twice while its package builds, the copy
    anonymous memory even where the weights are the file's mapping. The
    builder's model is its own, so its buffers can change kind: the package's
    constants keep their names, which is how an engine hands its tensors over."""
    moved = 0
    for sub in module.modules():
        for name, tensor in list(sub._buffers.items()):
            if tensor is None or tensor.is_mkldnn:
                continue
            del sub._buffers[name]
            sub._non_persistent_buffers_set.discard(name)
            sub.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
            moved += 1
    return moved


def build(config: EngineConfig, threads: int) -> pathlib.Path:
    """Export and compile the step of ``config``'s model into its package (in
    this process; ``step_package.build_in_subprocess`` runs it in one of its
    own); returns its path, at once when it is built already."""
    torch.set_num_threads(threads)   # inductor writes the thread count into its parallel loops
    use_compile_cache()
    runner = ModelRunner(dataclasses.replace(config, compile=False, num_kv_blocks=64, swap_space_blocks=0,
                                             speculative_config=None, tensor_parallel_size=1))
    path = step_package.package_path(runner)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    buffers_as_parameters(runner.model)
    batch = runner.prepare([SeqEntry([1, 2, 3], 0, [1]), SeqEntry([4, 5], 0, [2])])
    tokens = torch.export.Dim("tokens", min=1)
    started = time.perf_counter()
    with torch.inference_mode(), step_context(runner.kv_caches, batch.meta, runner.attention_ops):
        program = torch.export.export(_Forward(runner.model).eval(), (batch.input_ids, batch.positions),
                                      dynamic_shapes={"input_ids": {0: tokens},   # positions: [tokens] or M-RoPE's [3, tokens]
                                                      "positions": {batch.positions.dim() - 1: tokens}},
                                      strict=False)
    scratch = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")   # aoti wants the suffix; renamed once whole
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(scratch),
        inductor_configs={"aot_inductor.package_constants_in_so": False, "compile_threads": 1})
    os.replace(scratch, path)
    logger.info("pagedbackend: built the step package %s in %.0f s", path.name, time.perf_counter() - started)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbackend.worker.step_build",
                                     description="Build the compiled step package of one model setting.")
    parser.add_argument("--settings", required=True, help="JSON object of EngineConfig fields")
    parser.add_argument("--threads", type=int, required=True, help="the serving process's torch thread count")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build(EngineConfig(**json.loads(args.settings)), args.threads), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
