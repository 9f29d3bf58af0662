"""Structured outputs and tool calling for the OpenAI API: ``response_format``,
vLLM's ``structured_outputs`` and ``guided_*`` fields, and ``tools`` with
``tool_choice``, turned into the model's ``structured_outputs`` sampling
parameter; tool calls parsed back out of the generated text.

Tool calls are written in the Hermes style, one per block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and every ``tool_choice`` but ``none`` constrains them with an xgrammar
structural tag, so a call's arguments always match its function's
``parameters`` schema: ``auto`` lets free text run until the model opens a
``<tool_call>`` block; ``required`` allows only calls (at least one); a named
function allows exactly one call of it. ``parallel_tool_calls: false`` stops
after the first call. When the chat template does not render ``tools`` itself,
``TOOLS_PROMPT`` describes them in a system message; earlier assistant calls
and tool results are written back into the conversation in the same blocks.

Pure data: no network, no Triton.
"""
import json
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

from pagedbackend.serving.openai.protocol import OpenAIError

TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# What OpenAI allows as a function's name (a name is written into the call
# blocks, so it must not hold their markers).
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_PARSERS = ("hermes",)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
          "guided_decoding_backend", "guided_whitespace_pattern")

TOOLS_PROMPT = """You can call functions to answer. These are the functions, one JSON object each, between <tools> and </tools>:
<tools>
{tools}
</tools>
To call a function, write a JSON object with its name and arguments between <tool_call> and </tool_call>, one call per block:
<tool_call>
{{"name": "the function's name", "arguments": {{"the argument": "its value"}}}}
</tool_call>"""


def structured_outputs(req) -> Optional[dict]:
    """The model's ``structured_outputs`` parameter for a request: from
    ``structured_outputs`` itself, the ``guided_*`` fields or
    ``response_format`` (at most one of these), or None."""
    given = [name for name in ("structured_outputs", *GUIDED) if getattr(req, name, None) is not None]
    response_format = getattr(req, "response_format", None)
    if response_format and response_format.get("type") != "text":
        given.append("response_format")
    if "structured_outputs" in given and any(name.startswith("guided_") for name in given):
        raise OpenAIError(400, "structured_outputs and the guided_* fields must not both be set",
                          "structured_outputs")
    if "response_format" in given and len(given) > 1:
        raise OpenAIError(400, f"response_format must not be combined with {given[0]}", "response_format")
    if "response_format" in given:
        return _response_format(response_format)
    if getattr(req, "structured_outputs", None) is not None:
        return dict(req.structured_outputs)
    guided = {name[len("guided_"):]: getattr(req, name) for name in GUIDED if getattr(req, name) is not None}
    if not guided:
        return None
    if "decoding_backend" in guided:
        guided["backend"] = guided.pop("decoding_backend")
    return guided


def _response_format(value: Dict[str, Any]) -> dict:
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise OpenAIError(400, "response_format.json_schema must be an object with a name (and a schema)",
                              "response_format")
        schema = spec.get("schema")
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise OpenAIError(400, "response_format.json_schema.schema must be a JSON schema object",
                              "response_format")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(value)}
    raise OpenAIError(400, f"response_format.type must be text, json_object, json_schema or structural_tag, "
                      f"got {kind!r}", "response_format")


# ---------------------------------------------------------------- tools

class Tools:
    """A chat request's functions and its ``tool_choice``: ``none``,
    ``auto``, ``required`` or one function's name."""

    def __init__(self, tools: List[Any], tool_choice: Any, parallel: Optional[bool]):
        self.functions: Dict[str, dict] = {}
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise OpenAIError(400, f"{where}: only tools of type function are supported", "tools")
            function = tool.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise OpenAIError(400, f"{where}.function must be an object with a name", "tools")
            if not TOOL_NAME.fullmatch(function["name"]):
                raise OpenAIError(400, f"{where}.function.name {function['name'][:80]!r} must be 1 to 64 letters, "
                                  "digits, underscores or hyphens", "tools")
            parameters = function.get("parameters", {"type": "object"})
            if not isinstance(parameters, dict):
                raise OpenAIError(400, f"{where}.function.parameters must be a JSON schema object", "tools")
            if function["name"] in self.functions:
                raise OpenAIError(400, f"{where}: function {function['name']!r} is listed twice", "tools")
            self.functions[function["name"]] = {"name": function["name"], "parameters": parameters,
                                                **({"description": function["description"]}
                                                   if isinstance(function.get("description"), str) else {})}
        self.parallel = parallel is not False
        if tool_choice is None:
            tool_choice = "auto"
        if isinstance(tool_choice, dict):
            function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or name not in self.functions:
                raise OpenAIError(400, f"tool_choice names function {name!r}, which is not among the tools",
                                  "tool_choice")
            self.choice = name
        elif tool_choice in ("none", "auto", "required"):
            self.choice = tool_choice
        else:
            raise OpenAIError(400, 'tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")

    @classmethod
    def of(cls, req) -> Optional["Tools"]:
        if not req.tools:
            if req.tool_choice not in (None, "none"):
                raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
            return None
        return cls(req.tools, req.tool_choice, req.parallel_tool_calls)

    @property
    def calls(self) -> bool:
        """Tool calls may be generated (and are parsed out of the text)."""
        return self.choice != "none"

    def as_openai(self) -> List[dict]:
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def structural_tag(self) -> dict:
        """The constraint on the output for this ``tool_choice`` (not ``none``)."""
        names = list(self.functions) if self.choice in ("auto", "required") else [self.choice]
        tags = [{"begin": f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": self.functions[name]["parameters"]},
                 "end": f"}}\n{TOOL_CALL_END}"} for name in names]
        if self.choice == "auto":
            form = {"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN], "tags": tags,
                    "stop_after_first": not self.parallel}
        else:
            form = {"type": "tags_with_separator", "separator": "\n", "tags": tags, "at_least_one": True,
                    "stop_after_first": not self.parallel or self.choice != "required"}
        return {"type": "structural_tag", "format": form}

    def system_prompt(self) -> str:
        return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in self.as_openai()))


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def messages_with_tools(messages: List[dict], tools: Optional[Tools], knows_tools: bool) -> List[dict]:
    """The conversation for a template that cannot render tools: the tools
    described in a system message (joined to the first one, if any), earlier
    calls and tool results written as blocks in their messages. Every
    message's ``tool_calls`` are checked first (``check_tool_calls``)."""
    for i, message in enumerate(messages):
        check_tool_calls(message.get("tool_calls"), message["role"], f"messages[{i}]")
    if knows_tools:
        return messages
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if message["role"] == "assistant" and calls:
            blocks = [f"{TOOL_CALL_BEGIN}\n{json.dumps(_call_object(c))}\n{TOOL_CALL_END}" for c in calls]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        elif message["role"] == "tool":
            message["content"] = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
        out.append(message)
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + tools.system_prompt()}
        else:
            out.insert(0, {"role": "system", "content": tools.system_prompt()})
    return out


def check_tool_calls(calls: Any, role: str, where: str) -> None:
    """An assistant turn's ``tool_calls`` as OpenAI defines them: a list of
    objects, each with a ``function`` object holding a ``name`` and its
    ``arguments`` (JSON text); anything else is a 400 naming the place."""
    if calls is None:
        return
    where = f"{where}.tool_calls"
    if role != "assistant":
        raise OpenAIError(400, f"{where}: only an assistant message has tool calls", "messages")
    if not isinstance(calls, list):
        raise OpenAIError(400, f"{where} must be a list of tool calls, got {type(calls).__name__}", "messages")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise OpenAIError(400, f"{where}[{j}] must be an object with a function object", "messages")
        if call.get("type", "function") != "function":
            raise OpenAIError(400, f"{where}[{j}].type must be function", "messages")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise OpenAIError(400, f"{where}[{j}].function.name must be a non-empty string", "messages")
        if not isinstance(function.get("arguments"), str):
            raise OpenAIError(400, f"{where}[{j}].function.arguments must be a string (JSON text)", "messages")


def _call_object(call: Any) -> dict:
    """An OpenAI ``tool_calls`` entry as the block's JSON object."""
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return {"name": function.get("name"), "arguments": arguments}


def _tool_call(body: str) -> Optional[dict]:
    """One block's text as an OpenAI ``tool_calls`` entry, or None if it is not a call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> Tuple[Optional[str], List[dict]]:
    """(the text outside the call blocks, or None if there is none; the calls)."""
    stream = ToolCallStream()
    content = "".join(d.get("content", "") for d in stream.feed(text) + stream.finish())
    return (content.strip() or None), stream.calls


class ToolCallStream:
    """Splits generated text, piece by piece, into content deltas and
    complete tool calls. Text that may be the start of a ``<tool_call>``
    block is held back until it is known not to be."""

    def __init__(self):
        self.calls: List[dict] = []
        self._held = ""          # text not yet handed out
        self._inside = False     # within a call block

    def feed(self, text: str) -> List[dict]:
        self._held += text
        deltas = []
        while True:
            if self._inside:
                end = self._held.find(TOOL_CALL_END)
                if end < 0:
                    return deltas
                body, self._held = self._held[:end], self._held[end + len(TOOL_CALL_END):]
                self._inside = False
                call = _tool_call(body.strip())
                if call is None:   # not a call after all: it stays text
                    deltas.append({"content": TOOL_CALL_BEGIN + body + TOOL_CALL_END})
                else:
                    deltas.append({"tool_calls": [{"index": len(self.calls), **call}]})
                    self.calls.append(call)
                continue
            start = self._held.find(TOOL_CALL_BEGIN)
            if start >= 0:
                if start:
                    deltas.append({"content": self._held[:start]})
                self._held, self._inside = self._held[start + len(TOOL_CALL_BEGIN):], True
                continue
            keep = _partial_suffix(self._held, TOOL_CALL_BEGIN)
            if len(self._held) > keep:
                deltas.append({"content": self._held[:len(self._held) - keep]})
                self._held = self._held[len(self._held) - keep:]
            return deltas

    def finish(self) -> List[dict]:
        """What is left at the end (an unfinished block stays text)."""
        rest = (TOOL_CALL_BEGIN if self._inside else "") + self._held
        self._held, self._inside = "", False
        return [{"content": rest}] if rest else []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
