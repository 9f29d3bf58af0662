"""Model runner: owns the weights and the paged KV cache, and runs one step.

It knows nothing about scheduling or text: each step it receives, per
sequence, the tokens to compute, where they start and the block table that
holds them (``SeqEntry``, or the scheduler's ``ScheduledSeq``); it builds the
flat batch with the attention layout of the step (``batch.py``), runs the
forward pass and returns last-token logits. Copy-on-write and swapping arrive
as (src, dst) block pairs.
"""
import threading
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from pagedbackend.config import EngineConfig
from pagedbackend.core.kv_groups import kv_layout
from pagedbackend.kernels import get_attention_ops, hugepages
from pagedbackend.kernels.kv_cache_dtype import (INT8_FORMAT, cache_dtype, check_head_dim, check_triton_cache,
                                                 row_bytes, row_width)
from pagedbackend.models import ModelArgs
from pagedbackend.models.attention import ImageBlock, step_context
from pagedbackend.models.default_model import resolve_model_path
from pagedbackend.models.fp8_scales import KVScales
from pagedbackend.models import moe
from pagedbackend.models.linear import Reduce
from pagedbackend import quant
from pagedbackend.lora.punica import build_mapping, empty_mapping, lora_step
from pagedbackend.worker.batch import SeqEntry, StepBatch, build_step_batch
from pagedbackend.worker.compiled import CompiledStep
from pagedbackend.worker.cpu_wait import governor_for
from pagedbackend.worker.cuda_graphs import DecodeGraphs, decode_graphs_for
from pagedbackend.worker.image_blocks import image_blocks
from pagedbackend.worker.image_rows import ImageRows
from pagedbackend.worker.loader import DTYPES, kv_block_bytes, load_model, resolve_device
from pagedbackend.worker.step_source import prepare_step

__all__ = ["ModelRunner", "SeqEntry", "StepBatch"]


class ModelRunner:
    """Weights, KV cache (device) and swap cache (host) of one tensor-parallel rank."""

    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_size: int = 1,
                 reduce: Optional[Reduce] = None, compile_in_background: bool = False):
        """``compile_in_background``: on CPU, be ready with eager steps at once
        and compile in a thread of its own (``step_source.compile_in_background``); steps
        take the compiled function from the first one after it is warm
        (``step_source``)."""
        self.config = config = config.resolved(resolve_model_path(config.model))   # dtype "auto" made one
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.attention_ops = get_attention_ops(config.attention_backend, self.device)
        loaded = load_model(config, self.device, tp_rank, tp_size, reduce)
        self.model_path, self.model, self.max_model_len = loaded.path, loaded.model, loaded.max_model_len
        args = loaded.args
        # A model with multimodal RoPE (Qwen2.5-VL) computes its own [3, tokens] positions (models.mrope).
        self.positions_of = getattr(self.model, "step_positions", None)
        self.position_rows = () if self.positions_of is None else (3,)
        self.vocab_size = args.vocab_size
        self.hidden_size = args.hidden_size   # an embedding's length (pooling)
        self.num_labels = args.num_labels     # a sequence classifier's: pooled rows are its scores' logits
        self.num_heads = self.model.layers[0].self_attn.num_heads
        windows = self.model.layer_windows
        self.kv_layout = kv_layout(windows, free_out_of_window=not config.disable_hybrid_kv_cache_manager)
        # One attention plan per (KV group, window): a group's layers read its
        # block tables, each with its own window (in one group of every layer,
        # windowed layers keep their windows).
        self.attention_groups: List[Tuple[int, Optional[int]]] = sorted(
            set(zip(self.kv_layout.layer_group, windows)), key=lambda gw: (gw[0], gw[1] is not None, gw[1] or 0))
        self.layer_group = [self.attention_groups.index(gw) for gw in zip(self.kv_layout.layer_group, windows)]
        self._allocate_kv_cache(args)
        # An fp8 cache's per-layer k_scale / v_scale (checkpoint or calculated; None: scale 1).
        self.kv_scales = KVScales.for_model(self.model, self.kv_dtype, config.calculate_kv_scales)
        room = min((self.num_kv_blocks - 1) * self.block_size, self.max_model_len)
        calibration = quant.Calibration(self.model_path, room, self._calibration_prefill)
        self.linear_plan = quant.apply(self.model, config, self.device, self.dtype, calibration)
        self.linear_backend = self.linear_plan.backend   # what serves the float32 or int8 linear layers
        # What serves the experts of a mixture of experts (None: the model has none).
        self.moe_kernel = moe.use_kernel(self.model, config.moe_backend, self.device, self.dtype)
        self.lora = None   # with enable_lora: the adapted projections and their pool (lora.layers)
        if config.enable_lora:
            from pagedbackend.lora.layers import LoRAModel
            self.lora = LoRAModel(self.model, config.max_loras * config.max_lora_rank, self.dtype, self.device)
        self.model.eval()
        # A vision-language model's image rows: its vision encoder behind the encoder cache.
        self.image_rows = (ImageRows(self.model.vision, config.encoder_cache_bytes, self.device)
                           if getattr(self.model, "vision", None) is not None else None)
        self.compiled: Optional[CompiledStep] = None
        self.graphs: Optional[DecodeGraphs] = None
        self.compile_thread: Optional[threading.Thread] = None
        if tp_size == 1:   # a tensor-parallel step needs every rank: no lone warm-up
            prepare_step(self, compile_in_background and self.device.type == "cpu")
            self.graphs = decode_graphs_for(self)
        # How OpenMP threads wait between regions, by whether the cores are ours (cpu_wait).
        self.wait_governor = governor_for(self.device.type, torch.get_num_threads())
        if self.kv_scales is not None:
            self.kv_scales.arm()   # warm-ups done: the first served step calculates them (calculate_kv_scales)

    def _calibration_prefill(self, ids: List[int]) -> torch.Tensor:
        """The hidden states of a prefill of ``ids`` (for w8a8's smoothing); it
        writes only KV blocks that no sequence holds yet (1 onwards)."""
        blocks = list(range(1, 1 + -(-len(ids) // self.block_size)))
        batch = self.prepare([SeqEntry(ids, 0, blocks, need_logits=False)]).to(self.device)
        with torch.inference_mode(), step_context(self.kv_caches, batch.metas, self.attention_ops,
                                                  self.layer_group):
            return self.model(batch.input_ids, batch.positions)

    def wait_for_compile(self, timeout: Optional[float] = None) -> bool:
        """Wait for a background compile to end; True when the compiled step is in use."""
        if self.compile_thread is not None:
            self.compile_thread.join(timeout)
        return self.compiled is not None

    @property
    def compiled_step(self) -> bool:
        return self.compiled is not None

    @property
    def cpu_contended(self) -> bool:
        return self.wait_governor is not None and self.wait_governor.contended

    def describe(self) -> Dict[str, object]:
        """How the step computes: the linear layers (and whether through the
        C++ operators), attention, the LoRA kernel."""
        from pagedbackend.kernels.packed_linear import native_ops
        packed = self.linear_backend == "packed"
        return {"linear_backend": self.linear_backend,
                "native_ops": bool(native_ops().use_native_ops) if packed else False,
                "attention_backend": type(self.attention_ops).__name__,
                "lora_kernel": self.lora.kernel_name if self.lora is not None else None}

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives in this process (a background compile is a daemon thread)."""

    def warm_up(self, step=None, kv_caches=None) -> None:
        """Run a one-token and a two-token step with their logits: every graph
        (compiled or oneDNN's) is built now, not on the first request. Writes
        only to slot 0 of ``kv_caches`` (default the runner's, whose slot 0
        holds no sequence yet). ``step``: the ``(forward, logits)`` pair to warm
        up (default ``step_functions()``). Layers that take another branch
        from some number of rows (a graph of its own: int8 weights in torch's
        kernel) get one more step with that many sequences (``LinearPlan``).
        With adapters, each size runs again as a step with adapters (the
        graph that calls the LoRA op; its empty mapping adds nothing)."""
        for size in (1, 2, *self.linear_plan.warm_up_rows):
            for lora in (None, empty_mapping()) if self.lora is not None else (None,):
                batch = self.prepare([SeqEntry([0], 0, [0]) for _ in range(size)])
                batch.lora = lora
                self.execute_batch(batch, step=step, kv_caches=kv_caches)

    def _allocate_kv_cache(self, args: ModelArgs) -> None:
        self.block_size = self.config.block_size
        # The cache's own format (kv_cache_dtype): int8 rows carry their scale.
        self.kv_dtype = cache_dtype(self.config.kv_cache_dtype, self.dtype)
        check_head_dim(args.head_dim, self.kv_dtype)
        triton_ops = self.device.type == "cuda" and \
            self.attention_ops.write_kv is get_attention_ops("triton", self.device).write_kv
        if triton_ops:
            check_triton_cache(self.device, self.dtype, self.kv_dtype, self.config.kv_cache_dtype)
        row = row_bytes(args.head_dim, self.kv_dtype)
        block_shape = (self.block_size, self.model.num_kv_heads, row_width(args.head_dim, self.kv_dtype))
        slots = self.kv_layout.slots   # layers per block (every layer, for one KV group)
        self.kv_bytes_per_block = kv_block_bytes(args, self.block_size, self.model.num_kv_heads,
                                                 self.kv_dtype, layers=slots)
        self.num_kv_blocks = self.config.num_kv_blocks
        if self.num_kv_blocks is None:
            self.num_kv_blocks = self.config.kv_cache_bytes // self.kv_bytes_per_block
            if self.num_kv_blocks < 1:
                raise ValueError(
                    f"kv_cache_bytes={self.config.kv_cache_bytes} is too small for one KV block: "
                    f"a block needs {self.kv_bytes_per_block} bytes (2 x {slots} layers "
                    f"x {self.block_size} positions x {self.model.num_kv_heads} KV heads x "
                    f"{row} bytes of kv_cache_dtype {self.config.kv_cache_dtype})")
        # One tensor for all of it, so a block copy or swap is one indexed copy.
        # A block holds one KV group's layers, layer l in slot layer_slot[l].
        shape = (2, slots, self.num_kv_blocks, *block_shape)
        if self.device.type == "cpu":   # decodes read it in place, block by block: on 2 MiB pages
            self.kv_cache = hugepages.zeros(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, s], self.kv_cache[1, s]) for s in self.kv_layout.layer_slot]
        self.num_swap_blocks = self.config.swap_space_blocks
        self.swap_cache = None
        if self.num_swap_blocks > 0:
            self.swap_cache = torch.zeros((2, slots, self.num_swap_blocks, *block_shape),
                                          dtype=self.kv_dtype, device="cpu",
                                          pin_memory=self.device.type == "cuda")

    # ---- one step -------------------------------------------------------

    def execute_model(self, entries: Sequence[SeqEntry], hidden_out: Optional[List[torch.Tensor]] = None
                      ) -> torch.Tensor:
        """Run one step; float32 logits ``[entries needing logits, vocab]`` of
        each such entry's last token, in entry order. ``hidden_out``: a list
        that receives, per entry with ``return_hidden`` in order, its rows'
        hidden states after the final norm (float32, on the runner's device; pooling).
        A decode step replays its CUDA graph when there is one
        (``cuda_graphs``) and no adapter."""
        batch = self._flat_batch(entries)
        if self.lora is not None:
            batch.lora = build_mapping(entries, self.lora.split_rows)
        hidden_spans = _hidden_spans(entries) if hidden_out is not None else []
        with torch.inference_mode():
            images = self.image_rows.rows(entries) if self.image_rows is not None else None
        if (not hidden_spans and images is None and self.graphs is not None and batch.lora is None
                and self.graphs.fits(batch)):
            return self.graphs.run(batch)
        blocks = image_blocks(entries) if images is not None and self.image_rows.vision.bidirectional else ()
        return self.execute_batch(batch, hidden_spans=hidden_spans, hidden_out=hidden_out,   # plans the batch
                                  images=images, image_blocks=blocks)

    def execute_batch(self, batch: StepBatch, compute_logits: bool = True, step=None,
                      kv_caches=None, hidden_spans: Sequence[Tuple[int, int]] = (),
                      hidden_out: Optional[List[torch.Tensor]] = None,
                      images: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                      image_blocks: Sequence[ImageBlock] = ()) -> Optional[torch.Tensor]:
        """The forward pass of a prepared batch (host or device tensors); with
        ``compute_logits=False`` it only fills the KV cache (a worker rank).
        ``step`` and ``kv_caches`` replace ``step_functions()`` and the runner's
        cache (a warm-up). ``hidden_spans``: row ranges whose normed hidden
        states are appended to ``hidden_out``. ``images``: ``(rows, embeddings)``
        that replace those rows' token embeddings (``worker.image_rows``; an
        eager forward); ``image_blocks``: rows that attend both ways (``models.attention``)."""
        if batch.meta.plan is None:   # a worker rank's batch arrives without one
            self.plan(batch)
        batch = batch.to(self.device)
        forward, logits_of = step or self.step_functions()
        scales = self.kv_scales if kv_caches is None else None   # a scratch cache's warm-up: scale 1
        with torch.inference_mode(), step_context(kv_caches or self.kv_caches, batch.metas, self.attention_ops,
                                                  self.layer_group, image_blocks, scales), \
                lora_step(self.lora, batch.lora):
            if images is None:
                hidden = forward(batch.input_ids, batch.positions)
            else:
                embeds = self.model.embed(batch.input_ids)
                embeds[images[0]] = images[1].to(embeds.dtype)
                hidden = self.model.forward(batch.input_ids, batch.positions, embeds)
            if scales is not None and scales.step_done() and self.graphs is not None:
                self.graphs = decode_graphs_for(self)   # graphs captured at scale 1: again, at the calculated scales
            if hidden_spans:
                rows = torch.cat([torch.arange(a, b) for a, b in hidden_spans]).to(hidden.device)
                normed = self.model.norm(hidden[rows])
                normed = (normed if self.model.score is None else self.model.score(normed)).float()
                hidden_out.extend(normed.split([b - a for a, b in hidden_spans]))
            if not compute_logits:
                return None
            if len(batch.logits_rows) == 0:   # a prefill chunk that completes nothing
                return torch.empty((0, self.vocab_size), device=self.device)
            logits = logits_of(hidden[batch.logits_rows])
        return logits.float()

    def step_functions(self):
        """``(forward, logits)`` of the model: the compiled ones when there are."""
        if self.compiled is not None:
            return self.compiled.forward, self.compiled.logits
        return self.model.forward, self.model.compute_logits

    def prepare(self, entries: Sequence[SeqEntry]) -> StepBatch:
        """Check the entries and build the flat batch, with the step's
        attention plan, as host tensors."""
        batch = self._flat_batch(entries)
        self.plan(batch)
        return batch

    def _flat_batch(self, entries: Sequence[SeqEntry]) -> StepBatch:
        """The checked flat batch of ``entries`` as host tensors, not yet planned."""
        batch = build_step_batch(entries, self.block_size, self.max_model_len, self.vocab_size,
                                 self.num_kv_blocks, len(self.kv_layout.groups))
        if self.positions_of is not None:
            batch.positions = self.positions_of(entries, batch.positions)
        return batch

    def plan(self, batch: StepBatch) -> None:
        """Lay out the step for the attention kernels, once for the layers of
        each attention group (every layer, when they all attend alike)."""
        kv_metas, metas = batch.metas, []
        for i, (group, window) in enumerate(self.attention_groups):
            first_use = all(g != group for g, _ in self.attention_groups[:i])
            meta = kv_metas[group] if first_use else replace(kv_metas[group])
            meta.plan = self.attention_ops.plan(
                meta.cu_seqlens_q, meta.seq_lens, block_tables=meta.block_tables,
                slot_mapping=meta.slot_mapping, block_size=self.block_size, num_heads=self.num_heads,
                num_kv_heads=self.model.num_kv_heads, device=self.device, window=window)
            metas.append(meta)
        batch.meta, batch.groups = metas[0], (metas if len(metas) > 1 else [])

    # ---- block moves ----------------------------------------------------

    def copy_blocks(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> dst, K and V of every layer."""
        if pairs:
            src, dst = _pair_index(pairs, self.num_kv_blocks, self.num_kv_blocks, self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def swap_out(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Device block src -> host block dst."""
        if pairs:
            src, dst = _pair_index(pairs, self.num_kv_blocks, self._swap_blocks(), "cpu")
            self.swap_cache[:, :, dst] = self.kv_cache[:, :, src.to(self.device)].to("cpu")

    def swap_in(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Host block src -> device block dst."""
        if pairs:
            src, dst = _pair_index(pairs, self._swap_blocks(), self.num_kv_blocks, self.device)
            self.kv_cache[:, :, dst] = self.swap_cache[:, :, src.cpu()].to(self.device, non_blocking=True)

    def read_blocks(self, ids: Sequence[int]) -> List[bytes]:
        """Device blocks ``ids`` copied to the host, each as its bytes exactly
        as stored (K and V of every layer; an int8 cache's scales in its rows):
        the disk tier's saves, before the step overwrites them."""
        index = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        blocks = self.kv_cache[:, :, index].movedim(2, 0).contiguous().cpu()
        rows = blocks.view(len(ids), -1).view(torch.uint8)
        return [row.numpy().tobytes() for row in rows]

    def write_blocks(self, ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Bytes from ``read_blocks`` (the disk tier's loads) into device blocks ``ids``."""
        shape = (len(ids), 2, self.kv_cache.shape[1], *self.kv_cache.shape[3:])
        rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        blocks = rows.view(self.kv_cache.dtype).view(shape).movedim(0, 2)
        _pair_index([(i, i) for i in ids], self.num_kv_blocks, self.num_kv_blocks, "cpu")   # checks the ids
        self.kv_cache[:, :, torch.tensor(list(ids), device=self.device)] = blocks.to(self.device)

    def kv_block_layout(self) -> Dict[str, object]:
        """What a block's bytes mean (the disk tier refuses a file written for another)."""
        return {"kv_shape": [2, *self.kv_cache.shape[1:2], *self.kv_cache.shape[3:]], "block_size": self.block_size,
                "cache_dtype": str(self.kv_cache.dtype), "kv_cache_dtype": self.config.kv_cache_dtype,
                "row_format": INT8_FORMAT if self.kv_cache.dtype == torch.int8 else "",
                "layers": self.kv_layout.slots, "groups": len(self.kv_layout.groups),
                **(self.kv_scales.describe() if self.kv_scales is not None else {})}

    def _swap_blocks(self) -> int:
        if self.swap_cache is None:
            raise ValueError("no swap space: set swap_space_blocks > 0 to swap blocks to the host")
        return self.num_swap_blocks


def _hidden_spans(entries: Sequence[SeqEntry]) -> List[Tuple[int, int]]:
    """The flat batch's row range of each entry with ``return_hidden``, in order."""
    spans, row = [], 0
    for entry in entries:
        if entry.return_hidden:
            spans.append((row, row + len(entry.token_ids)))
        row += len(entry.token_ids)
    return spans


def _pair_index(pairs: Sequence[Tuple[int, int]], src_blocks: int, dst_blocks: int,
                device) -> Tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(pairs, dtype=torch.long).view(-1, 2)
    src, dst = index[:, 0], index[:, 1]
    if src.min() < 0 or src.max() >= src_blocks or dst.min() < 0 or dst.max() >= dst_blocks:
        raise ValueError(f"block pair outside the caches ({src_blocks} source, {dst_blocks} "
                         f"destination blocks): {list(pairs)}")
    return src.to(device), dst.to(device)
