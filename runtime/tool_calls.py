"""Tool calls (OpenAI `tools` + `tool_choice`): the prompt that offers the tools, the grammar that
keeps a call well formed, and the reply's `tool_calls`, whole or streamed.

A model writes its calls in the format its chat template taught it (`ToolCallFormat`): Hermes
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` for the ChatML families
(SmolLM2, Qwen, OLMo), the one format llmc knows today. A template that takes `tools` itself renders
them; for one that does not, the tools are described in a system message in the format's terms,
and earlier calls and tool results in the conversation are written as that format spells them.

tool_choice decides the grammar (runtime/grammar.py), so a call always parses and its arguments
always validate against the tool's schema:
  none        the tools are not offered; plain text
  auto        text that does not start like a call, or one or more calls
  required    one or more calls, to any of the tools
  {"type": "function", "function": {"name": N}}   the arguments of one call to N (the output is
              the arguments object itself, as vLLM does)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .grammar import JSON_OPTIONS, GrammarSpec
from .sampling_params import RequestError
from .tokenizer import Tokenizer

NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict       # the arguments' JSON schema

    def openai(self) -> dict[str, Any]:
        """As OpenAI's request spells a tool (what chat templates that take `tools` expect)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family writes a call (each wrapped in open/close, several joined by `separator`) and
    how a tool's result is shown to it (wrapped in result_open/result_close)."""

    name: str
    open: str
    close: str
    separator: str
    result_open: str
    result_close: str

    def write(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON text) as the model writes them."""
        return self.separator.join(f'{self.open}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{self.close}'
                                   for name, arguments in calls)

    def read(self, text: str) -> list[tuple[str, str]] | None:
        """The calls in `text` (name, arguments JSON text); None unless `text` is calls and nothing else
        (not even a space before them: the grammar reads that as text, whose calls it never checked)."""
        bodies = re.findall(re.escape(self.open) + "(.*?)" + re.escape(self.close), text, flags=re.DOTALL)
        if not bodies or self.separator.join(self.open + b + self.close for b in bodies) != text:
            return None
        calls = [_loads(body, dict) for body in bodies]
        if not all(c and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict) for c in calls):
            return None
        return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


# The ChatML families' format (SmolLM2, Qwen 2 / 2.5 / 3, OLMo 2, Hermes): what a template without
# tools of its own is taught. Another family's format is one more ToolCallFormat and a rule below.
HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "<tool_response>\n", "\n</tool_response>")


def tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template teaches (every template llmc knows uses or accepts Hermes')."""
    return HERMES


def _loads(text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, kind) else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------- requests


def parse_tools(tools: list[Any]) -> list[Tool]:
    """OpenAI's `tools` list as Tools (at most MAX_TOOLS, OpenAI's limit); RequestError naming the
    entry at fault."""
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"{len(tools)} tools are more than the {MAX_TOOLS} allowed; send fewer", "tools")
    parsed = []
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, _ . or -; got {name!r}",
                               f"{where}.function.name")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object",
                               f"{where}.function.parameters")
        parsed.append(Tool(name, function.get("description"), parameters))
    if len({t.name for t in parsed}) != len(parsed):
        raise RequestError("tools has two functions of the same name; give each its own", "tools")
    return parsed


def named_choice(tool_choice: Any, tools: list[Tool]) -> Tool | None:
    """The tool a `{"type": "function", "function": {"name": N}}` tool_choice names."""
    if not isinstance(tool_choice, dict):
        return None
    name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools; name one of "
                           f"{', '.join(t.name for t in tools) or '(none given)'}", "tool_choice")
    return tool


def calls_grammar(tools: list[Tool], fmt: ToolCallFormat, allow_text: bool) -> GrammarSpec:
    """A Lark grammar: one or more calls to `tools` in `fmt` (or, with allow_text, text that does
    not begin like a call); each call's arguments follow its tool's schema, compact JSON."""
    body = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t.name}, "arguments": t.parameters}} for t in tools],
            "x-guidance": JSON_OPTIONS}
    calls = f"calls: call ({json.dumps(fmt.separator)} call)*\n" \
            f"call: {json.dumps(fmt.open)} %json {json.dumps(body)} {json.dumps(fmt.close)}"
    start = "start: TEXT | calls\nTEXT: /[^" + re.escape(fmt.open[0]) + r"][\s\S]*/" if allow_text else "start: calls"
    return GrammarSpec("grammar", f"{start}\n{calls}\n", "tools")


# ---------------------------------------------------------------------------------- the prompt


def tools_system_prompt(tools: list[Tool], fmt: ToolCallFormat) -> str:
    """The tools described for a model whose chat template does not render them itself."""
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    example = fmt.write([("<function-name>", "<arguments-json-object>")])
    return ("# Tools\n\nYou may call one or more of these functions to help with the user's request. "
            f"Their signatures, one JSON object per line:\n<tools>\n{listed}\n</tools>\n\n"
            f"To call a function, reply with a JSON object of its name and arguments, like this:\n{example}")


def plain_messages(messages: list[dict[str, Any]], tools: list[Tool], fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """Messages for a chat template without tools of its own: the tools described in the system
    message, earlier calls written in `fmt`, tool results shown as the format shows them (as user turns)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": fmt.result_open + m["content"] + fmt.result_close})
        elif m.get("tool_calls"):
            calls = fmt.write([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], calls]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = tools_system_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ------------------------------------------------------------------------------ plan and reply


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its reply.
    mode: "none", "auto", "required" or "named" (the call to `named`, arguments only)."""

    tools: list[Tool]
    mode: str
    fmt: ToolCallFormat
    named: Tool | None = None

    @property
    def offered(self) -> list[Tool]:
        """The tools the prompt shows the model (none for tool_choice "none")."""
        return [] if self.mode == "none" else self.tools

    def grammar(self) -> GrammarSpec | None:
        if self.mode == "named":
            return GrammarSpec.json_schema(self.named.parameters, "tool_choice")
        if self.mode in ("auto", "required"):
            return calls_grammar(self.tools, self.fmt, allow_text=self.mode == "auto")
        return None

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """The calls a finished reply made (name, arguments JSON text), or None for a text reply."""
        if self.mode == "named":
            return [(self.named.name, text)] if _loads(text, dict) is not None else None
        return self.fmt.read(text) if self.mode in ("auto", "required") else None


def plan_tools(tools: list[Any] | None, tool_choice: Any, chat_template: str | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); RequestError naming the field at fault."""
    if tool_choice is not None and not tools:
        raise RequestError("tool_choice needs tools; send the tools it chooses from", "tool_choice")
    if not tools:
        return None
    parsed = parse_tools(tools)
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolPlan(parsed, tool_choice or "auto", tool_call_format(chat_template))
    if isinstance(tool_choice, dict):
        return ToolPlan(parsed, "named", tool_call_format(chat_template), named_choice(tool_choice, parsed))
    raise RequestError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                       f'{{"name": ...}}}}; got {tool_choice!r}', "tool_choice")


def call_entries(calls: list[tuple[str, str]], ids: list[str]) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` for a whole reply."""
    return [{"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in zip(ids, calls)]


class ToolCallStream:
    """One streamed choice's text turned into OpenAI chat deltas: `content` for text, `tool_calls`
    (index, id, type, name, then argument pieces) for calls. A named call streams its arguments as
    they come; other calls are held until the reply ends and sent whole, one delta entry each; in
    "auto", text is held only while it could still be the start of a call. As in the whole reply,
    held text becomes calls only when the reply ended with "stop" (cut short, it is sent as text)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""
        self.is_text = plan.mode == "none"
        self.call_id = new_call_id()

    def delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The delta for a piece of the reply's text; `finish_reason` set on the last piece."""
        if self.plan.mode == "named":
            return self._named(text)
        self.held += text
        opening = self.plan.fmt.open
        if not self.is_text and self.plan.mode == "auto" and not (
                opening.startswith(self.held) or self.held.startswith(opening)):
            self.is_text = True
        if self.is_text:
            out, self.held = self.held, ""
            return {"content": out} if out else {}
        return self._calls(finish_reason == "stop") if finish_reason is not None else {}

    def _named(self, text: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if self.call_id:
            entry |= {"id": self.call_id, "type": "function"}
            entry["function"] = {"name": self.plan.named.name, "arguments": text}
            self.call_id = ""
        return {"tool_calls": [entry]} if text or "id" in entry else {}

    def _calls(self, complete: bool) -> dict[str, Any]:
        calls = self.plan.calls(self.held) if complete else None
        if calls is None:         # cut short (max_tokens) or not calls: what there is, as text
            return {"content": self.held} if self.held else {}
        return {"tool_calls": [{"index": i, **entry} for i, entry in
                               enumerate(call_entries(calls, [new_call_id() for _ in calls]))]}


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[int]:
    """The chat's prompt ids with the plan's tools offered: by the template where it takes tools
    (earlier calls' arguments handed to it as objects, as transformers does), else by plain_messages.
    The caller's messages are left as they are."""
    offered, fmt = (plan.offered, plan.fmt) if plan else ([], tool_call_format(tokenizer.files.chat_template))
    if tokenizer.template_takes_tools:
        messages = [m | {"tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
                    if m.get("tool_calls") else m for m in messages]
        return tokenizer.encode_chat(messages, tools=[t.openai() for t in offered] or None)
    return tokenizer.encode_chat(plain_messages(messages, offered, fmt))


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A call entry whose arguments (JSON text) are an object, as templates that take tools read them."""
    function = call["function"]
    return call | {"function": function | {"arguments": _loads(function["arguments"], dict) or {}}}
