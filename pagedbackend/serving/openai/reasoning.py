"""Reasoning models' thinking in the chat API, as vLLM's ``reasoning_parser``
setting (``--reasoning-parser qwen3`` or ``deepseek_r1``): the text up to
``</think>`` goes to ``message.reasoning_content`` (``delta.reasoning_content``
when streamed), the rest to ``content``; structured outputs and tool calls
apply to the text after the reasoning (the constraint lets any text through
up to ``</think>``, then starts).

One rule, the same for streamed and whole answers:

- the output is all content when the prompt has already closed its reasoning
  (Qwen3's template with ``enable_thinking: false`` writes an empty
  ``<think></think>`` into it), or, with ``qwen3``, when the request's
  ``chat_template_kwargs`` say ``enable_thinking: false``;
- otherwise it starts as reasoning (DeepSeek-R1's and newer Qwen templates
  open ``<think>`` in the prompt; one the model writes first is dropped) until
  ``</think>``; an output that never closes it is all reasoning.

Pure data: no network, no Triton.
"""
import json
from typing import List, Optional, Tuple

from pagedbackend.serving.openai.protocol import OpenAIError
from pagedbackend.structured.params import STRUCTURED_KINDS

REASONING_PARSERS = ("deepseek_r1", "qwen3")
# Arguments of the chat-template call itself, which chat_template_kwargs may not set.
TEMPLATE_CALL_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                           "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                           "padding", "truncation", "max_length", "tokenizer_kwargs",
                           "return_assistant_tokens_mask")
THINK_BEGIN, THINK_END = "<think>", "</think>"
# What the reasoning may hold before the constraint starts: any text, up to and with </think>.
REASONING_FORMAT = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}


def template_kwargs(req) -> dict:
    """A chat request's ``chat_template_kwargs`` (vLLM's): variables its chat
    template reads, e.g. Qwen3's ``enable_thinking``."""
    given = getattr(req, "chat_template_kwargs", None) or {}
    for key in given:
        if key in TEMPLATE_CALL_ARGUMENTS:
            raise OpenAIError(400, f"chat_template_kwargs.{key} is not a template variable (the server sets "
                              "it)", "chat_template_kwargs")
    return dict(given)


class Reasoning:
    """One chat request's reasoning: whether its output starts as thinking,
    how its text splits, and its constraint moved after the thinking."""

    def __init__(self, parser: str, prompt: str, chat_template_kwargs: Optional[dict] = None,
                 include: bool = True):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        thinking_off = parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking", True) is False
        closed = prompt.rfind(THINK_END) > prompt.rfind(THINK_BEGIN)
        self.thinking = not (thinking_off or closed)   # the output starts as reasoning
        self.include = include                         # reasoning_content is returned

    @classmethod
    def of(cls, parser: Optional[str], req, prompt: str) -> Optional["Reasoning"]:
        if parser is None:
            return None
        return cls(parser, prompt, req.chat_template_kwargs, req.include_reasoning)

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.thinking)

    def split(self, text: str) -> Tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output; None where there is none."""
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        reasoning = "".join(r for r, _ in pieces) if any(r is not None for r, _ in pieces) else None
        content = "".join(c for _, c in pieces if c) or None
        return reasoning, content

    def constrain(self, constraint: Optional[dict]) -> Optional[dict]:
        """The ``structured_outputs`` parameter with its constraint applied
        after the reasoning: an xgrammar structural tag whose first part is any
        text up to ``</think>``."""
        if constraint is None or not self.thinking:
            return constraint
        kinds = [kind for kind in STRUCTURED_KINDS if constraint.get(kind) not in (None, False)]
        if len(kinds) != 1:   # the engine names the problem
            return constraint
        options = {key: value for key, value in constraint.items() if key not in STRUCTURED_KINDS}
        tag = {"type": "structural_tag",
               "format": {"type": "sequence", "elements": [REASONING_FORMAT, _format(kinds[0], constraint[kinds[0]])]}}
        return {**options, "structural_tag": json.dumps(tag)}


def _format(kind: str, value) -> dict:
    """One structured-output constraint as an xgrammar structural-tag format."""
    if kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(value) if isinstance(value, str) else value}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in value]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": value}
    tag = json.loads(value) if isinstance(value, str) else value
    if isinstance(tag, dict) and isinstance(tag.get("format"), dict):
        return tag["format"]
    if isinstance(tag, dict) and "structures" in tag:   # vLLM's first form: triggered begin/schema/end
        return {"type": "triggered_tags", "triggers": list(tag.get("triggers", [])),
                "tags": [{"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s.get("schema", {})},
                          "end": s["end"]} for s in tag["structures"]]}
    raise OpenAIError(400, "structural_tag must be an object with a format (or structures and triggers)",
                      "structured_outputs")


class ReasoningStream:
    """Splits generated text, piece by piece, into (reasoning, content)
    pieces. Text that may be the start of ``<think>`` (at the very start) or
    of ``</think>`` is held back until it is known."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self._held = ""
        self._opening = thinking   # a leading <think> may still come

    def feed(self, text: str) -> List[Tuple[Optional[str], Optional[str]]]:
        self._held += text
        if not self.thinking:
            out, self._held = self._held, ""
            return [(None, out)] if out else []
        if self._opening:
            start = self._held.lstrip()
            if THINK_BEGIN.startswith(start):   # still only (part of) an opening tag
                return []
            self._opening = False
            if start.startswith(THINK_BEGIN):
                self._held = start[len(THINK_BEGIN):]
        end = self._held.find(THINK_END)
        if end >= 0:
            reasoning, content = self._held[:end], self._held[end + len(THINK_END):]
            self._held, self.thinking = "", False
            return [(reasoning, content or None)]
        keep = _partial_suffix(self._held, THINK_END)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return [(out, None)] if out else []

    def finish(self) -> List[Tuple[Optional[str], Optional[str]]]:
        """What is held at the end: reasoning still, if it never closed."""
        rest, self._held = self._held, ""
        if not rest:
            return []
        return [(rest, None)] if self.thinking else [(None, rest)]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
