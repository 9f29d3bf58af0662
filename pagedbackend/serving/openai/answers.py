"""How the OpenAI endpoints shape what the model produced: each choice's text,
tokens and logprobs gathered per request (``Run``), then written as stream
chunks or one answer object, the completions way or the chat way."""
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional, Tuple

from pagedbackend.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                                  completion_logprobs, join_logprobs, prompt_completion_logprobs)
from pagedbackend.serving.openai.reasoning import Reasoning, ReasoningStream
from pagedbackend.serving.openai.structured import ToolCallStream, Tools, parse_tool_calls
from pagedbackend.serving.openai.triton_client import Update

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


@dataclass
class Choice:
    """What one returned choice has produced so far."""
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: Optional[str] = None
    positions: list = field(default_factory=list)   # logprobs entries, one per token
    sent: bool = False                              # a chunk of it has been streamed

    def add(self, update: Update, i: int) -> Tuple[str, list, Optional[str]]:
        """Fold output ``i`` of ``update`` in; returns its new text, its new
        logprobs positions and, if it just finished, the finish reason."""
        text = update.texts[i]
        self.text += text
        self.num_tokens += update.num_tokens[i]
        positions = (update.logprobs[i] if update.logprobs is not None else None) or []
        self.positions.extend(positions)
        finished = None
        if update.reasons[i] is not None and self.finish_reason is None:
            self.finish_reason = finished = update.reasons[i]
        return text, positions, finished


class Run:
    """One API request's choices (``n`` per prompt, choice ``p * n + i`` is
    output ``i`` of prompt ``p``) and its token usage."""

    def __init__(self, num_prompts: int, n: int):
        self.n = n
        self.choices = [Choice(p * n + i) for p in range(num_prompts) for i in range(n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens: List[Optional[int]] = [None] * num_prompts
        self.prompt_logprobs: List[Optional[list]] = [None] * num_prompts
        self.score_only = False   # echo with max_tokens 0: what was generated is not returned

    def count_prompt(self, prompt: int, update: Update) -> None:
        if update.num_input_tokens is not None:
            self.prompt_tokens[prompt] = update.num_input_tokens
        if update.num_cached_tokens is not None:
            self.cached_tokens[prompt] = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = update.prompt_logprobs

    def fold(self, prompt: int, update: Update):
        """Per output of ``update``, folded in turn: (choice, new text, new
        positions, finish reason)."""
        self.count_prompt(prompt, update)
        for i in range(len(update.texts)):
            choice = self.choices[prompt * self.n + i]
            yield (choice, *choice.add(update, i))

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = 0 if self.score_only else sum(c.num_tokens for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if any(c is not None for c in self.cached_tokens):   # prefix-cache hits, as OpenAI reports them
            usage["prompt_tokens_details"] = {"cached_tokens": sum(c or 0 for c in self.cached_tokens)}
        return usage


class Answer:
    """How one endpoint shapes its choices: as stream chunks or one object."""

    wants_prompt_logprobs = False

    def __init__(self, req, model: str, prefix: str, top: Optional[int]):
        self.req, self.model, self.top = req, model, top
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        options = req.stream_options
        self.usage_chunks = options is not None and options.include_usage
        self.running_usage = options is not None and options.continuous_usage_stats

    def chunk(self, run: Run, choices: list, final_usage: bool = False) -> bytes:
        payload = {"id": self.id, "object": self.chunk_object, "created": self.created,
                   "model": self.model, "choices": choices}
        if self.usage_chunks or self.running_usage:
            payload["usage"] = run.usage() if final_usage or self.running_usage else None
        return sse(payload)

    async def chunks(self, run: Run, updates) -> AsyncIterator[bytes]:
        """The events of each update, joined into one write (the first one
        after the opening events)."""
        opened = False
        async for prompt, update in updates:
            pieces = []
            if not opened:
                run.count_prompt(prompt, update)
                pieces, opened = self.opening(run), True
            for choice, text, positions, finished in run.fold(prompt, update):
                piece = self.delta(run, choice, text, positions, finished)
                if piece is not None:
                    choice.sent = True
                    pieces.append(piece)
            if pieces:
                yield b"".join(pieces)
        if self.usage_chunks:
            yield self.chunk(run, [], final_usage=True)

    def opening(self, run: Run) -> List[bytes]:
        return []

    def whole(self, run: Run) -> dict:
        return {"id": self.id, "object": self.whole_object, "created": self.created, "model": self.model,
                "choices": [self.whole_choice(c, run) for c in run.choices], "usage": run.usage()}


class CompletionAnswer(Answer):
    chunk_object = whole_object = "text_completion"

    def __init__(self, req: CompletionRequest, model: str, prompts: list, tokenizer):
        super().__init__(req, model, "cmpl", req.logprobs)
        # Echoed text: the prompt, or the text of its token ids.
        self.texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        self.wants_prompt_logprobs = req.echo and req.logprobs is not None
        self.first_tokens = []   # the text of each prompt's first token (it has no log-probability)
        if self.wants_prompt_logprobs:
            for p in prompts:
                ids = p if not isinstance(p, str) else tokenizer.encode(p)
                self.first_tokens.append(tokenizer.decode(ids[:1]))

    def _echo(self, choice: Choice) -> str:
        return self.texts[choice.index // self.req.n] if self.req.echo else ""

    def _prompt_logprobs(self, run: Run, choice: Choice) -> Optional[dict]:
        prompt = choice.index // self.req.n
        if not self.wants_prompt_logprobs or run.prompt_logprobs[prompt] is None:
            return None
        return prompt_completion_logprobs(self.first_tokens[prompt], run.prompt_logprobs[prompt], self.top)

    def delta(self, run, choice, text, positions, finished) -> Optional[bytes]:
        if run.score_only:
            text, positions = "", []
        echo = "" if choice.sent else self._echo(choice)
        if not (echo or text or positions or finished):
            return None
        logprobs = None
        if self.top is not None:  # offsets continue the choice's text, echoed prompt included
            sent = len(echo) if echo else len(self._echo(choice)) + len(choice.text) - len(text)
            logprobs = completion_logprobs(positions, self.top, sent)
            prompt = self._prompt_logprobs(run, choice) if echo else None
            if prompt is not None:
                logprobs = join_logprobs(prompt, logprobs)
        return self.chunk(run, [{"index": choice.index, "text": echo + text, "logprobs": logprobs,
                                 "finish_reason": finished}])

    def whole_choice(self, choice: Choice, run: Run) -> dict:
        text, positions = ("", []) if run.score_only else (choice.text, choice.positions)
        logprobs = None
        if self.top is not None:
            echo = self._echo(choice)
            logprobs = completion_logprobs(positions, self.top, len(echo))
            prompt = self._prompt_logprobs(run, choice)
            if prompt is not None:
                logprobs = join_logprobs(prompt, logprobs)
        return {"index": choice.index, "text": self._echo(choice) + text,
                "finish_reason": choice.finish_reason, "logprobs": logprobs}


class ChatAnswer(Answer):
    chunk_object, whole_object = "chat.completion.chunk", "chat.completion"

    def __init__(self, req: ChatCompletionRequest, model: str, tools: Optional[Tools] = None,
                 reasoning: Optional[Reasoning] = None):
        super().__init__(req, model, "chatcmpl", (req.top_logprobs or 0) if req.logprobs else None)
        self.tools = tools if tools is not None and tools.calls else None
        self.tool_streams: Dict[int, ToolCallStream] = {}
        self.reasoning = reasoning   # splits the thinking off (reasoning.py), or None
        self.reasoning_streams: Dict[int, ReasoningStream] = {}

    def opening(self, run: Run) -> List[bytes]:
        return [self.chunk(run, [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]) for c in run.choices]

    def delta(self, run, choice, text, positions, finished) -> Optional[bytes]:
        if not (text or positions or finished):
            return None
        logprobs = None if self.top is None else {"content": chat_logprobs(positions, self.top)}
        if self.tools is None and self.reasoning is None:
            return self.chunk(run, [{"index": choice.index, "delta": {"content": text} if text else {},
                                     "logprobs": logprobs, "finish_reason": finished}])
        items = self._items(choice, text, finished)
        if not items and positions:
            items = [({}, None)]
        return b"".join(self.chunk(run, [{"index": choice.index, "delta": d, "finish_reason": reason,
                                          "logprobs": logprobs if i == 0 else None}])
                        for i, (d, reason) in enumerate(items)) or None

    def _items(self, choice: Choice, text: str, finished: Optional[str]) -> List[Tuple[dict, Optional[str]]]:
        """(delta, finish reason) of new text: reasoning, content and tool calls."""
        pieces = [(None, text)]
        if self.reasoning is not None:
            stream = self.reasoning_streams.setdefault(choice.index, self.reasoning.stream())
            pieces = stream.feed(text) + (stream.finish() if finished else [])
        tools = self.tool_streams.setdefault(choice.index, ToolCallStream()) if self.tools is not None else None
        items = []
        for reasoning, content in pieces:
            if reasoning and self.reasoning.include:
                items.append(({"reasoning_content": reasoning}, None))
            if content:
                items += [(d, None) for d in (tools.feed(content) if tools is not None else [{"content": content}])]
        if finished:
            items += [(d, None) for d in (tools.finish() if tools is not None else [])]
            items.append(({}, "tool_calls" if tools is not None and tools.calls and finished == "stop" else finished))
        return items

    def whole_choice(self, choice: Choice, run: Run) -> dict:
        reasoning, text = None, choice.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(choice.text)
        message = {"role": "assistant", "content": text}
        reason = choice.finish_reason
        if self.tools is not None:
            content, calls = parse_tool_calls(text or "")
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "tool_calls" if reason == "stop" else reason
        if self.reasoning is not None and self.reasoning.include:
            message["reasoning_content"] = reasoning
        return {"index": choice.index, "message": message,
                "logprobs": None if self.top is None else {"content": chat_logprobs(choice.positions, self.top)},
                "finish_reason": reason}

