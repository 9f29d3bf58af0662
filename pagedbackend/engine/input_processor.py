"""From a request to engine state: tokenise the prompt, check it against the
model and the KV pool, and build its sequence group (bad-word ids, beam
state, a structured-output grammar queued for the compile thread). Nothing here
changes engine state, so any thread may build a group."""
import dataclasses
import logging
import time
from typing import List, Optional, Sequence, Union

from ..config import EngineConfig
from ..core.kv_groups import step_blocks
from ..core.scheduler import Scheduler
from ..core.sequence import SequenceGroup
from ..sample import BeamSearchState
from ..structured.compiler import GrammarCompiler
from ..multimodal.inputs import block_keys
from ..multimodal.processor import processor_for  # noqa: F401  (the engine builds InputProcessor's with it)
from ..multimodal.prompt import split_prompt
from ..pooling_params import PoolingParams
from ..sampling_params import InvalidRequestError, SamplingParams

Prompt = Union[str, List[int], dict]   # dict: vLLM's, with multi_modal_data (multimodal.prompt)
PROMPT_CHARS_PER_TOKEN = 16   # default max_prompt_chars per token of max_model_len
logger = logging.getLogger("pagedbackend")


def fit_max_model_len(model_len: int, num_kv_blocks: int, config: EngineConfig,
                      windows: Sequence[Optional[int]] = (None,)) -> int:
    """The longest sequence one request may reach: one sequence of it must
    fit the pool alone (with a block to spare for a copy-on-write), so a
    longer ``max_model_len`` is capped, with a log line. Computed before the
    scheduler is built, from the pool it will build. ``windows``: each KV
    group's sliding window (a windowed group holds a bounded number of
    blocks per sequence, however long it grows)."""
    if not 0.0 <= config.watermark < 1.0:
        return model_len   # the block manager refuses the watermark, naming it
    bs = config.block_size
    # The blocks that admission may use: the pool less the block manager's
    # watermark (BlockManager.watermark_blocks, Scheduler.usable_blocks).
    usable = num_kv_blocks - int(config.watermark * num_kv_blocks)
    bounds = [step_blocks(w, bs, config.max_num_batched_tokens) for w in windows]

    def blocks(length: int) -> int:   # per group: its blocks for the sequence, and two to spare
        return sum(-(-length // bs) + 2 if b is None else min(-(-length // bs), b) + 2 for b in bounds)
    if blocks(model_len) <= usable:
        return model_len
    low, high = 0, model_len   # the longest length that fits: blocks() grows with it
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if blocks(mid) <= usable else (low, mid - 1)
    fits = low
    where = (f"the KV pool ({num_kv_blocks} blocks of {bs}, "
             f"{usable} usable) holds one sequence of at most {max(fits, 0)} tokens")
    if fits < 1:
        raise ValueError(f"the KV cache is too small to serve anything: {where}; give more KV blocks")
    logger.warning("max_model_len capped from %d to %d: %s", model_len, fits, where)
    return fits


class InputProcessor:
    """Turns ``(request_id, prompt, params)`` into a ``SequenceGroup`` or an
    ``InvalidRequestError`` that says why it can never be served."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_prompt_chars: int,
                 scheduler: Scheduler, grammars: GrammarCompiler, multimodal=None):
        """``multimodal``: a vision-language model's ``multimodal.processor.MultiModalProcessor``
        (None: the model takes text only)."""
        self.tokenizer = tokenizer
        self.multimodal = multimodal
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.scheduler = scheduler   # asked only (what fits the pool), never changed
        self.grammars = grammars

    def make_group(self, request_id: str, prompt: Prompt, params: Optional[SamplingParams] = None,
                   arrival_time: Optional[float] = None, cumulative_logprob: bool = False,
                   priority: Optional[int] = None) -> SequenceGroup:
        """Check a request against the model and the pool and build its group.
        Outputs carry ``cumulative_logprob`` when the parameters need it
        (logprobs, best_of > n, beam search) or ``cumulative_logprob`` is
        true; otherwise None. ``priority`` (vLLM's argument) replaces the
        parameters' own under ``scheduling_policy=priority``."""
        params = params or SamplingParams()
        if priority is not None:   # one route in: the parameters' own field, checked there
            params = dataclasses.replace(params, priority=priority)
        params.check_token_ids(self.vocab_size)
        text, token_ids, items = self._tokenize(prompt)
        if items and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt with images")
        if params.truncate_prompt_tokens is not None and len(token_ids) > params.truncate_prompt_tokens:
            token_ids = token_ids[-params.truncate_prompt_tokens:]   # vLLM keeps the last k
            text = None if text is None else self.tokenizer.decode(token_ids)
        max_tokens = params.max_tokens
        room = self.max_model_len - len(token_ids)
        if max_tokens is None:   # the rest of the context, as far as the pool holds every candidate
            if room < 1:
                raise InvalidRequestError(f"prompt has {len(token_ids)} tokens; the model's context "
                                          f"is {self.max_model_len}, leaving no room to generate")
            max_tokens = self.scheduler.capacity.max_tokens_that_fit(len(token_ids), params.best_of, room) or room
        if len(token_ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = "
                f"{len(token_ids) + max_tokens} exceeds the maximum context length {self.max_model_len}")
        group = SequenceGroup(request_id, text, token_ids, params,
                              time.time() if arrival_time is None else arrival_time, max_tokens)
        self._attach_images(group, items)
        self.scheduler.check_admissible(group)
        group.wants_logprob |= cumulative_logprob
        group.bad_words_ids = self._bad_words_ids(params)
        if params.use_beam_search:
            group.beam = BeamSearchState(params.beam_width, params.length_penalty, params.early_stopping)
        if params.structured_outputs is not None:   # parsed and compiled on the compile thread
            group.grammar = self.grammars.submit(params.structured_outputs)
        return group

    def make_pooling_group(self, request_id: str, prompt: Prompt, pooling: PoolingParams,
                           arrival_time: Optional[float] = None, priority: Optional[int] = None) -> SequenceGroup:
        """The group of an embedding request (``pooling``: resolved against the
        model): its prompt is computed and pooled; it samples nothing (one
        token of room is reserved, as for any prompt, and never used)."""
        text, token_ids, items = self._tokenize(prompt)
        if items:
            raise InvalidRequestError("embedding requests take text only, not images")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"input has {len(token_ids)} tokens; the maximum context length "
                                      f"is {self.max_model_len}")
        params = SamplingParams(max_tokens=1, **({} if priority is None else {"priority": priority}))
        group = SequenceGroup(request_id, text, token_ids, params,
                              time.time() if arrival_time is None else arrival_time, 1)
        group.pooling = pooling
        self.scheduler.check_admissible(group)
        return group

    def _tokenize(self, prompt: Prompt):
        """``(text, token ids, image items)`` of a prompt; text is None for a prompt of ids."""
        if isinstance(prompt, dict):
            prompt, images = split_prompt(prompt)
            if images:
                return self._tokenize_with_images(prompt, images)
        return (*self._tokenize_text(prompt), [])

    def _tokenize_with_images(self, prompt, images):
        if self.multimodal is None:
            raise InvalidRequestError("this model takes no image input (multi_modal_data): it serves text only")
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise InvalidRequestError(f"prompt has {len(prompt)} characters; the limit is {self.max_prompt_chars} "
                                      f"(engine setting max_prompt_chars)")
        ids, items = self.multimodal.process(prompt, images)
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens with its images' placeholders; the "
                                      f"maximum context length is {self.max_model_len}")
        return prompt, ids, items

    def _attach_images(self, group: SequenceGroup, items) -> None:
        """The group's images, and their hashes by block for the prefix cache."""
        if items:   # samples and beams share the prompt's blocks, and so its images
            group.mm_items = list(items)
            group.block_keys = block_keys(items, self.scheduler.bm.block_size)

    def _tokenize_text(self, prompt):
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if len(prompt) > self.max_prompt_chars:
                raise InvalidRequestError(
                    f"prompt has {len(prompt)} characters; the limit is {self.max_prompt_chars} "
                    f"(engine setting max_prompt_chars)")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InvalidRequestError("prompt is empty after tokenisation")
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) > self.max_model_len:   # refused before the ids are checked one by one
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the maximum context length "
                                      f"is {self.max_model_len}")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} is not an integer in the vocabulary "
                                      f"[0, {self.vocab_size})")
        return None, ids

    def _bad_words_ids(self, params: SamplingParams) -> List[List[int]]:
        """Token sequences of each bad word, alone and after a space (the two
        ways a word is usually tokenised), as vLLM bans them."""
        found = []
        for word in params.bad_words or []:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found
