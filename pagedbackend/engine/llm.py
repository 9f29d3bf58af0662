"""Offline batch generation, ``LLM(...).generate(prompts, sampling_params)``,
and embeddings, ``LLM(..., runner="pooling").embed(texts)``."""
import itertools
from typing import Dict, List, Optional, Sequence, Union

from ..config import EngineConfig
from ..lora import LoRARequest
from .llm_engine import LLMEngine, Prompt
from .outputs import (CompletionOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                      ScoringRequestOutput)
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "default", **kwargs):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (also done when the LLM is
        garbage-collected), and the KV-event publisher."""
        self.engine.runner.shutdown()
        self.engine.kv_events.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None,
                 lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None
                 ) -> List[RequestOutput]:
        """Generate for every prompt (strings or token id lists); outputs come back
        in prompt order with whole texts and token lists. ``priority``: one per
        prompt, as vLLM's (lower first under ``scheduling_policy=priority``).
        ``lora_request``: the adapter of every prompt, or a list with one per
        prompt (None: the base model), as vLLM takes it (``enable_lora=True``)."""
        self._check_runner("generate", "generate")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_request)} LoRA requests")
        order = []
        for i, (prompt, params, lora) in enumerate(zip(prompts, sampling_params, lora_request)):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params,
                                    priority=None if priority is None else priority[i], lora_request=lora)
            order.append(request_id)
        merged: Dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="requests", unit="req")
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                merge_delta(merged, delta)
                if delta.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [merged[r] for r in order]


    def embed(self, prompts: Union[Prompt, Sequence[Prompt]],
              pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
              use_tqdm: bool = False) -> List[EmbeddingRequestOutput]:
        """One embedding per prompt (strings or token id lists), in prompt
        order: ``outputs[i].outputs.embedding`` is a list of floats, as vLLM's
        ``LLM.embed``. Needs ``runner="pooling"`` (or a sentence-transformers folder)."""
        self._check_runner("pooling", "embed")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(pooling_params)} pooling params")
        order = []
        for prompt, params in zip(prompts, pooling_params):
            order.append(f"offline-{next(self._ids)}")
            self.engine.add_request(order[-1], prompt, params)
        done: Dict[str, EmbeddingRequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"embedding request {out.request_id} failed: {out.error}")
                done[out.request_id] = out
        return [done[r] for r in order]

    def score(self, query: Union[str, Sequence[str]], documents: Union[str, Sequence[str]],
              use_tqdm: bool = False) -> List[ScoringRequestOutput]:
        """A cross-encoder's score of ``query`` with each document (or of each
        query with the document of the same index), in document order:
        ``outputs[i].outputs.score``, as vLLM's ``LLM.score``."""
        self._check_runner("pooling", "score")
        if not self.engine.pooling.num_labels:
            raise ValueError("LLM.score needs a cross-encoder or a sequence classifier (*ForSequenceClassification); "
                             "this model serves embeddings (LLM.embed)")
        documents = [documents] if isinstance(documents, str) else list(documents)
        queries = [query] * len(documents) if isinstance(query, str) else list(query)
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries but {len(documents)} documents")
        pairs = [{"text": q, "text_pair": d} for q, d in zip(queries, documents)]
        outs = self.embed(pairs, use_tqdm=use_tqdm)
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.embedding[0]))
                for o in outs]

    def _check_runner(self, runner: str, method: str) -> None:
        served = self.engine.config.runner
        if served != runner:
            raise ValueError(f"LLM.{method} needs runner={runner!r}; this model is served with "
                             f"runner={served!r} (LLM(model=..., runner=...))")


def merge_delta(merged: Dict[str, RequestOutput], delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the accumulated output of its request."""
    acc = merged.get(delta.request_id)
    if acc is None:
        acc = merged[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt, delta.prompt_token_ids, [], False, delta.metrics)
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    by_index = {o.index: o for o in acc.outputs}
    for out in delta.outputs:
        cur = by_index.get(out.index)
        if cur is None:
            cur = by_index[out.index] = CompletionOutput(out.index, "", [], logprobs=[] if out.logprobs is not None else None)
        cur.text += out.text
        cur.token_ids += out.token_ids
        if out.logprobs is not None:
            cur.logprobs = (cur.logprobs or []) + out.logprobs
        cur.cumulative_logprob = out.cumulative_logprob
        cur.finish_reason, cur.stop_reason, cur.num_tokens = out.finish_reason, out.stop_reason, out.num_tokens
    acc.outputs = [by_index[i] for i in sorted(by_index)]
    acc.finished, acc.error, acc.metrics = delta.finished, delta.error, delta.metrics
    acc.refused = delta.refused
    return acc
