"""OpenAI response bodies: whole completions, streamed chunks, usage and logprobs.

`Reply` builds the JSON for one HTTP request of either endpoint ("text_completion" for
/v1/completions, "chat.completion" for /v1/chat/completions), from the engine's outputs per
choice. Streaming follows OpenAI's chunk format: chat chunks carry a `delta` (the first one the
assistant role), completion chunks carry `text`; the last chunk of a choice carries its
`finish_reason`; with `stream_options.include_usage` every chunk has `"usage": null` and one more
chunk with no choices carries the usage. A chat request with tools (tool_calls.py) answers a call
as `tool_calls` with finish_reason "tool_calls", and streams it in OpenAI's tool-call deltas.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .request import RequestOutput
from .sampler import SampleResult
from .tokenizer import Tokenizer
from .tool_calls import ToolCallStream, ToolPlan, call_entries, new_call_id


@dataclass
class Choice:
    """One choice's outputs so far."""

    index: int
    prompt_tokens: int
    prefix: str = ""                     # the prompt's text when echoing
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleResult] = field(default_factory=list)
    prompt_logprobs: list[SampleResult] = field(default_factory=list)    # echo with logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    tool_stream: ToolCallStream | None = None     # a streamed chat choice with tools
    called: bool = False                          # ... that has sent a tool call

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.prompt_logprobs += out.prompt_logprobs or []
        if out.finished:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error


def usage(choices: list[Choice], prompts_tokens: list[int]) -> dict[str, int]:
    """OpenAI usage: each prompt counted once (whatever n), every generated token once."""
    prompt = sum(prompts_tokens)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Reply:
    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer, include_usage: bool = False,
                 tools: ToolPlan | None = None):
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.tools = tools
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ----------------------------------------------------------------- logprobs

    def _token(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def _chat_logprobs(self, results: list[SampleResult]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self._token(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}

        return {"content": [{**entry(r.token_id, r.logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in r.top_logprobs]} for r in results]}

    def _text_logprobs(self, results: list[SampleResult], offset: int) -> dict[str, Any]:
        tokens = [self._token(r.token_id) for r in results]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in results],
                "top_logprobs": [{self._token(t): lp for t, lp in r.top_logprobs} if r.logprob is not None else None
                                 for r in results],
                "text_offset": offsets}

    def _logprobs(self, results: list[SampleResult], offset: int,
                  prompt: list[SampleResult] | None = None) -> dict[str, Any] | None:
        """The logprobs of generated tokens from `offset` on; for an echoed prompt, its tokens' first
        (from offset 0; the first token's logprob null, as OpenAI's legacy completions give it)."""
        if not results and not prompt:
            return None
        if self.chat:
            return self._chat_logprobs(results)
        body = self._text_logprobs(results, offset)
        if prompt:
            head = self._text_logprobs(prompt, 0)
            body = {key: head[key] + body[key] for key in body}
        return body

    # ---------------------------------------------------------------- whole body

    def response(self, choices: list[Choice], prompts_tokens: list[int]) -> dict[str, Any]:
        """The non-streaming body."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._final_choice(c) for c in choices]
        body["usage"] = usage(choices, prompts_tokens)
        return body

    def _final_choice(self, c: Choice) -> dict[str, Any]:
        logprobs = self._logprobs(c.logprobs, len(c.prefix), c.prompt_logprobs)
        if self.chat:
            calls = self.tools.calls(c.text) if self.tools and c.finish_reason == "stop" else None
            message = {"role": "assistant", "content": c.text}
            if calls:
                message = {"role": "assistant", "content": None,
                           "tool_calls": call_entries(calls, [new_call_id() for _ in calls])}
            return {"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason}
        return {"index": c.index, "text": c.prefix + c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    # ------------------------------------------------------------------- chunks

    def chunk(self, c: Choice, out: RequestOutput | None, first: bool) -> dict[str, Any]:
        """A streamed chunk for choice `c`: its first (role / echoed prompt) or an output's delta."""
        text = out.new_text if out else ""
        if first and not self.chat:
            text = c.prefix + text
        offset = len(c.prefix) + len(c.text) - len(out.new_text) if out else 0
        choice: dict[str, Any] = {"index": c.index,
                                  "logprobs": self._logprobs(out.logprobs if out else [], offset,
                                                             out.prompt_logprobs if out else None),
                                  "finish_reason": out.finish_reason if out and out.finished else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else self._delta(c, out)
            if c.called and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return body

    def _delta(self, c: Choice, out: RequestOutput) -> dict[str, Any]:
        """A chat chunk's delta: the text, or, with tools, what the choice's tool stream makes of it."""
        if self.tools is None:
            return {"content": out.new_text}
        if c.tool_stream is None:
            c.tool_stream = ToolCallStream(self.tools)
        delta = c.tool_stream.delta(out.new_text, out.finish_reason if out.finished else None)
        c.called = c.called or "tool_calls" in delta
        return delta

    def usage_chunk(self, choices: list[Choice], prompts_tokens: list[int]) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(choices, prompts_tokens)
        return body
