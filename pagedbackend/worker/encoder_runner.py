"""The executor of an encoder model (BERT, XLM-RoBERTa; ``models.bert``):
each step runs every scheduled input whole, packed one after another
without padding, with bidirectional attention and no KV cache.

Why not the paged cache: an encoder's token attends to the tokens after it,
so its K/V are useful only within the one forward pass that computes the
whole input; nothing needs them afterwards (no decode follows, and a
prefix-cache hit could not stand in for positions whose hidden states
depend on later tokens). Inputs are at most 512 tokens, so the step's
attention over each input at once is small, and keeping K/V in blocks
would cost memory and copies for nothing.

How it fits the engine: the scheduler still admits these requests through
its block manager, whose pool here is bookkeeping only (no memory behind
it: ``num_kv_blocks`` bounds how many inputs are in flight). An encoder
request is never chunked (``SequenceGroup.whole_prompt``): it is scheduled
in the first step whose token budget has room for all of it, and an input
longer than ``max_num_batched_tokens`` (or ``long_prefill_token_threshold``)
is refused when submitted, naming the setting (``engine.pooling``). It
takes no prefix-cache hit. Such a model serves only embedding and score
requests (``runner=pooling``), so no generation shares its steps.
"""
import json
from typing import Dict, List, Optional, Sequence

import torch

from pagedbackend.config import EngineConfig
from pagedbackend.core.kv_groups import kv_layout
from pagedbackend.kernels import onednn_linear
from pagedbackend.models.bert import Encoder, parse_encoder_config
from pagedbackend.models.default_model import resolve_model_path
from pagedbackend.worker.loader import DTYPES, fit_model_len, read_safetensors, resolve_device

__all__ = ["EncoderRunner"]


class EncoderRunner:
    """An encoder's weights and its step; the ``Executor`` members the engine reads."""

    unchunked_prompts = True   # every input is computed whole in one step (engine.pooling)
    lora = None

    def __init__(self, config: EngineConfig):
        self.config = config = config.resolved(resolve_model_path(config.model))
        self.model_path = resolve_model_path(config.model)
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.args = args = parse_encoder_config(json.loads((self.model_path / "config.json").read_text()))
        with torch.device(self.device):
            self.model = Encoder(args).to(self.dtype)
        self.model.load_weights(read_safetensors(self.model_path))
        self.model.eval()
        # every step is a prefill: oneDNN's inner product on weights in its own layout beats
        # F.linear from one input's rows up (kernels.onednn_linear); linear_backend=torch keeps F.linear
        self.linear_backend = "torch"
        if config.linear_backend != "torch" and self.device.type == "cpu" and onednn_linear.unavailable() is None:
            self.model.use_onednn()
            self.linear_backend = "onednn"
        self.vocab_size, self.hidden_size = args.vocab_size, args.hidden_size
        self.num_labels = args.num_labels if args.classifier else 0   # a cross-encoder's scores
        self.max_model_len = fit_model_len(config.max_model_len, args.served_positions)
        self.block_size = config.block_size
        self.kv_layout = kv_layout([None])
        # Admission bookkeeping only: a step's worth of inputs, and a few more waiting.
        per_input = -(-self.max_model_len // self.block_size) + 2
        self.num_kv_blocks = config.num_kv_blocks or max(
            2 * (-(-config.max_num_batched_tokens // self.block_size) + config.max_num_seqs), 2 * per_input)

    # ---- one step -------------------------------------------------------

    def execute_model(self, entries: Sequence, hidden_out: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Run every entry's input whole; each entry's last hidden states
        (float32 ``[tokens, hidden]``) go to ``hidden_out`` in order. A
        cross-encoder's entries get one row each: its logits. Returns the
        empty logits of a step that samples nothing."""
        if any(e.need_logits or e.prompt_logits for e in entries):
            raise ValueError("an encoder model does not generate text (runner=pooling)")
        if any(e.start_pos != 0 for e in entries):
            raise ValueError("an encoder computes each input whole: an entry starts at a position past 0")
        if hidden_out is None:
            raise ValueError("an encoder step returns hidden states: hidden_out is needed")
        lengths = [len(e.token_ids) for e in entries]
        types = torch.zeros(sum(lengths), dtype=torch.long)   # segments: a pair's document is 1
        start = 0
        for e, n in zip(entries, lengths):
            bad = [t for t in e.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            if e.token_type_start is not None:
                types[start + e.token_type_start:start + n] = 1
            start += n
        ids = torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, lengths, types.to(self.device))
            if self.num_labels:
                hidden_out.extend(self.model.classify(hidden, lengths).float().unsqueeze(1).unbind(0))
            else:
                hidden_out.extend(part.float() for part in hidden.split(lengths))
        return torch.empty((0, self.vocab_size), device=self.device)

    # ---- what an encoder has none of ------------------------------------

    def copy_blocks(self, pairs) -> None:
        """No KV cache: nothing to copy."""

    def swap_out(self, pairs) -> None:
        """No KV cache: nothing to swap."""

    def swap_in(self, pairs) -> None:
        """No KV cache: nothing to swap."""

    @property
    def compiled_step(self) -> bool:
        return False

    def wait_for_compile(self, timeout: Optional[float] = None) -> bool:
        return False

    @property
    def cpu_contended(self) -> bool:
        return False

    def describe(self) -> Dict[str, object]:
        return {"linear_backend": self.linear_backend, "native_ops": False,
                "attention_backend": "encoder (sdpa, no KV cache)", "lora_kernel": None}

    def shutdown(self) -> None:
        """Nothing to stop."""
