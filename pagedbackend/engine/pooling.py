"""Embedding requests in the engine: a group whose prompt is computed like
any prefill, in the same steps and under the same token budget as
generation, but whose rows' hidden states (after the final norm) are pooled
instead of sampled. When its last prompt chunk is computed the pooled vector
is its output and the group ends: its KV blocks go back at once.

Chunked prefill feeds the pooler chunk by chunk (``models.pooler``). A MEAN
or CLS pooler reads every position's hidden state, which a cached prefix
does not have, so those requests never take a prefix-cache hit
(``SequenceGroup.reuses_cached_prefix``); LAST needs only the last token,
which is always computed, so it may. A group preempted for recompute starts
its pooling again with its prompt.
"""
import dataclasses
import pathlib
import time
from typing import Dict, List, Optional, Sequence as Seq, Union

import torch

from ..core.scheduler import ScheduledSeq, StepUpdate
from ..core.sequence import SequenceGroup
from ..models.pooler import PoolAccumulator
from ..config import EngineConfig
from ..pooling_choice import PoolingDefaults, read_pooling_defaults
from ..pooling_params import PoolingParams
from ..sampling_params import InvalidRequestError, SamplingParams
from .input_processor import InputProcessor, Prompt
from .scoring import is_pair, score_of, tokenize_pair
from .step_sampler import isolated
from .token_updates import TokenUpdates

RequestParams = Union[SamplingParams, PoolingParams]   # what a request asks: text or an embedding


class PoolingRequests:
    """The engine's embedding requests between their first chunk and their output."""

    def __init__(self, hidden_size: int, defaults: PoolingDefaults, tensor_parallel_size: int = 1,
                 whole_prompt_tokens: Optional[int] = None, num_labels: int = 0):
        """``whole_prompt_tokens``: for an encoder (``worker.encoder_runner``),
        each input is computed whole in one step, so it may have at most this
        many tokens (``max_num_batched_tokens``); None: prompts are chunked.
        ``num_labels``: a cross-encoder's (its requests are scores, ``engine.scoring``); 0: an embedder."""
        self.num_labels = num_labels
        self.hidden_size = hidden_size
        self.defaults = defaults
        self.tensor_parallel_size = tensor_parallel_size
        self.whole_prompt_tokens = whole_prompt_tokens
        self.pooled: Dict[str, PoolAccumulator] = {}   # by request id

    @classmethod
    def for_model(cls, executor, config: EngineConfig, model_path: pathlib.Path) -> "PoolingRequests":
        """For the model ``executor`` runs, with its pooler (``config.pooling_type``,
        resolved) and its normalisation: a sentence-transformers folder's, else
        L2 (vLLM's embed). An executor with ``unchunked_prompts`` computes each
        input whole (an encoder: ``worker.encoder_runner``)."""
        folder = read_pooling_defaults(model_path)
        unchunked = getattr(executor, "unchunked_prompts", False)
        return cls(executor.hidden_size, PoolingDefaults(config.pooling_type or "LAST",
                                                folder.normalize if folder is not None else True),
                   config.tensor_parallel_size, config.max_num_batched_tokens if unchunked else None,
                   getattr(executor, "num_labels", 0))

    @staticmethod
    def wants(params: Optional[RequestParams]) -> bool:
        """Whether a request with these parameters is an embedding request."""
        return isinstance(params, PoolingParams)

    def make_group(self, inputs: InputProcessor, request_id: str, prompt: Prompt, params: PoolingParams,
                   arrival_time: Optional[float] = None, priority: Optional[int] = None) -> SequenceGroup:
        """An embedding request's group (``InputProcessor.make_pooling_group``)."""
        if self.tensor_parallel_size > 1:
            raise InvalidRequestError("embedding requests are served with tensor_parallel_size=1")
        segment = None
        if is_pair(prompt):
            if not self.num_labels:
                raise InvalidRequestError("a text pair is scored by a cross-encoder; this model serves embeddings")
            prompt, segment = tokenize_pair(inputs.tokenizer, prompt, inputs.max_prompt_chars)
        group = inputs.make_pooling_group(request_id, prompt, self.resolve(params), arrival_time, priority)
        group.token_type_start = segment
        if self.whole_prompt_tokens is not None:
            n = len(group.prompt_token_ids)
            if n > self.whole_prompt_tokens:
                raise InvalidRequestError(
                    f"input has {n} tokens; an encoder computes each input whole in one step, and "
                    f"max_num_batched_tokens is {self.whole_prompt_tokens}")
            group.whole_prompt = True
        return group

    def resolve(self, params: Optional[PoolingParams]) -> PoolingParams:
        """``params`` with the model's pooler and normalisation where it names
        none; ``dimensions`` checked against the hidden size."""
        params = params or PoolingParams()
        if self.num_labels:   # a cross-encoder's one row is its logit: nothing to choose
            if params.dimensions is not None or params.pooling_type not in (None, "LAST"):
                raise InvalidRequestError("a cross-encoder's score takes no dimensions or pooling_type")
            return PoolingParams(pooling_type="LAST", normalize=False)
        params.check_dimensions(self.hidden_size)
        return dataclasses.replace(
            params, pooling_type=params.pooling_type or self.defaults.pooling_type,
            normalize=self.defaults.normalize if params.normalize is None else params.normalize)

    def take(self, scheduled: Seq[ScheduledSeq], hidden: List[torch.Tensor], update: StepUpdate,
             tokens: TokenUpdates, failed: Dict) -> List[SequenceGroup]:
        """Pool this step's rows of every pooling entry (``hidden``: one tensor
        per entry with ``return_hidden``, in order); a group whose prompt is
        now computed gets its embedding and finishes. Returns those groups."""
        done = []
        for item, rows in zip([i for i in scheduled if i.return_hidden], hidden):
            group = item.group
            if isolated(group, failed, "pooling its hidden states",
                        lambda: self._add(group, item, rows, update, tokens), update) and group.is_finished:
                done.append(group)
        return done

    def _add(self, group: SequenceGroup, item: ScheduledSeq, rows: torch.Tensor, update: StepUpdate,
             tokens: TokenUpdates) -> None:
        params, rid = group.pooling, group.request_id
        pooled = self.pooled.get(rid)
        if pooled is None or item.start_pos < pooled.num_tokens:   # new, or preempted and recomputed
            pooled = self.pooled[rid] = PoolAccumulator(params.pooling_type)
        pooled.add(rows, item.start_pos)
        seq = item.seq
        if item.start_pos + len(item.token_ids) < seq.num_tokens:
            return
        del self.pooled[rid]
        vector = pooled.result(params.dimensions, params.normalize)
        group.embedding = (score_of(vector) if self.num_labels else vector).tolist()
        now = time.time()
        group.metrics.first_token_time = group.metrics.last_token_time = now
        seq.finish_reason = "stop"
        update.freed.append(seq)
        group.seqs.remove(seq)
        group.finished_seqs.append(seq)
        tokens.finish_group(group, update)

    def forget(self, request_id: str) -> None:
        """Drop what was pooled of a request that ended otherwise (aborted, failed)."""
        self.pooled.pop(request_id, None)
