"""The OpenAI request bodies llmc serves, parsed strictly, and their translation to SamplingParams.

Bodies are validated as JSON in pydantic's strict mode: a number sent as a string or a boolean
sent as an integer is refused, as OpenAI refuses it. Every refusal is an `APIError` carrying the
HTTP status, OpenAI's error type and the offending parameter, so the server answers with OpenAI's
error JSON naming the field. Fields that would change the meaning of a request and that llmc
cannot honour (logit_bias, functions, ...) are refused rather than silently ignored; unknown
fields are ignored, as vLLM and OpenAI ignore them.

Structured output: `response_format` (`json_object`, `json_schema`) on both endpoints, and vLLM's
`structured_outputs` for the rest, exactly one of `json` (a schema), `regex`, `choice` (a list of
strings), `grammar` (Lark or GBNF) or `json_object: true`. vLLM's older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` are refused with the new spelling named.

Prefix-cache isolation: vLLM's `cache_salt` (1 to 1024 characters) on both endpoints; a request
reuses cached prompt KV only from requests that sent the same salt.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .grammar import GrammarSpec
from .sampling_params import RequestError, SamplingParams

MAX_N = 128                      # OpenAI's own limit on choices per request


class APIError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, the parameter at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCallEntry(_Strict):
    """A call an earlier assistant turn made, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallEntry] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class _GenerationRequest(_Strict):
    """Fields both endpoints share (OpenAI's, plus vLLM's sampling extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None       # vLLM's: cached prompt KV is shared only with requests of the same salt
    # accepted by OpenAI, not honoured here: refused by name instead of ignored
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None
    suffix: str | None = None
    # vLLM's removed spellings: refused, naming structured_outputs
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def unsupported(self) -> str | None:
        for name in ("logit_bias", "functions", "suffix"):
            if getattr(self, name):
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16         # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False                  # with logprobs: the prompt's tokens' logprobs too
    tools: Any = None                   # chat only: refused here by name

    def unsupported(self) -> str | None:
        return "tools" if self.tools is not None else super().unsupported()


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "content": "must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "stop": "must be a string or a list of strings",
}


def _param_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _describe(error: dict) -> APIError:
    """One sentence for pydantic's first complaint, naming the parameter as OpenAI does."""
    loc, kind = tuple(error["loc"]), error["type"]
    if kind == "json_invalid":
        return APIError(f"the request body is not valid JSON ({error['msg']}); send a JSON object")
    if not loc:
        return APIError("the request body must be a JSON object")
    for i, part in enumerate(loc):
        if part in _UNION_HINTS and i + 1 < len(loc) and isinstance(loc[i + 1], str):
            param = _param_path(loc[:i + 1])
            return APIError(f"{param} {_UNION_HINTS[part]}", param=param)
    param = _param_path(loc)
    if kind == "missing":
        return APIError(f"{param} is required", param=param)
    return APIError(f"{param}: {error['msg'][0].lower()}{error['msg'][1:]}", param=param)


def parse_request(model: type[_GenerationRequest], raw: bytes) -> Any:
    """Validate a JSON body as `model`; APIError naming the first bad field otherwise."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        raise _describe(exc.errors()[0]) from None
    if name := request.unsupported():
        if name == "tools":
            raise APIError("tools are taken by /v1/chat/completions only; send the request there", param=name)
        raise APIError(f"{name} is not supported by this server; remove it from the request", param=name)
    if guided := next((f for f in GUIDED_FIELDS if getattr(request, f) is not None), None):
        raise APIError(f"{guided} is no longer accepted (vLLM removed it); send structured_outputs: "
                       f'{{"{GUIDED_FIELDS[guided]}": ...}} instead', param=guided)
    if not 1 <= request.n <= MAX_N:
        raise APIError(f"n={request.n} must be between 1 and {MAX_N}", param="n")
    return request


def grammar_spec(request: _GenerationRequest) -> GrammarSpec | None:
    """The request's output constraint from response_format or structured_outputs (not both)."""
    fmt, outputs = request.response_format, request.structured_outputs
    if fmt is not None and fmt.type != "text" and outputs is not None:
        raise RequestError("response_format and structured_outputs both constrain the output; send one",
                           "structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec.json_schema({"type": "object"}, "response_format")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RequestError('response_format of type "json_schema" needs a json_schema: {"name": ..., '
                               '"schema": {...}}', "response_format.json_schema")
        return GrammarSpec.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    return _structured_outputs_spec(outputs) if outputs is not None else None


def _structured_outputs_spec(outputs: StructuredOutputs) -> GrammarSpec:
    given = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
             if getattr(outputs, name) not in (None, False)]
    if len(given) != 1:
        raise RequestError("structured_outputs takes exactly one of json, regex, choice, grammar or json_object; "
                           f"got {', '.join(g.rstrip('_') for g in given) or 'none'}", "structured_outputs")
    kind, param = given[0], f"structured_outputs.{given[0].rstrip('_')}"
    if kind == "json_":
        schema = outputs.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(f"{param} is not valid JSON: {exc}", param) from None
        return GrammarSpec.json_schema(schema, param)
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"}, param)
    if kind == "choice":
        return GrammarSpec.choice(outputs.choice, param)
    return GrammarSpec(kind, getattr(outputs, kind), param)


def sampling_params(request: _GenerationRequest, max_tokens: int, logprobs: int | None,
                    grammar: GrammarSpec | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The SamplingParams of choice 0; RequestError's parameter becomes the APIError's."""
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature,
            top_k=0 if request.top_k == -1 else request.top_k, top_p=request.top_p, min_p=request.min_p,
            repetition_penalty=request.repetition_penalty, frequency_penalty=request.frequency_penalty,
            presence_penalty=request.presence_penalty, seed=request.seed, stop=stop,
            stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos, logprobs=logprobs,
            grammar=grammar, prompt_logprobs=prompt_logprobs, cache_salt=request.cache_salt)
    except RequestError as exc:
        raise APIError(str(exc), param=exc.param) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: with a seed, choice j draws from seed + j (wrapping within
    64 bits), so the n choices differ from each other and the whole answer repeats for the same seed."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63) for j in range(n)]


def completion_logprobs(request: CompletionRequest) -> int | None:
    return request.logprobs


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def chat_max_tokens(request: ChatCompletionRequest) -> int | None:
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template takes them; 'developer' is OpenAI's newer name for 'system'.
    Earlier tool calls and results keep their `tool_calls` and `tool_call_id`. Every message but an
    assistant's needs content (an assistant's may be only tool calls), as OpenAI requires."""
    messages = []
    for i, m in enumerate(request.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            param = f"messages[{i}].content"
            raise APIError(f"{param} is required for a {m.role} message", param=param)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def prompt_list(request: CompletionRequest) -> list[str | list[int]]:
    """The completion request's prompts: one string or token list each."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError("prompt is empty; send a string or token ids", param="prompt")
    return prompts
