"""Structured output and tool calls through the official openai client against a real `llmc serve`
on the embedded SmolLM2-135M-Instruct: parsed pydantic objects validate, json_object is JSON, regex
and choice constraints hold exactly, a forced tool call's arguments validate, streaming gives what
the whole reply gives, and bad constraints are 400s naming the field while the server stays up."""

from __future__ import annotations

import asyncio
import json
import re
from enum import Enum

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from llmc.runtime.engine import Engine
from llmc.runtime.server import ServerConfig

from live_server import LiveServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_artifact):
    live = LiveServer(Engine(smollm2_artifact), ServerConfig(model_name="smollm2"))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=50)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    home: City                                         # nested object


class Inventory(BaseModel):
    items: list[str] = Field(min_length=1, max_length=4)   # an array with bounds
    total: int = Field(ge=1, le=100)
    in_stock: bool


@pytest.mark.parametrize("model, question", [
    (Person, "Describe a fictional person as JSON."),
    (City, "Give facts about Paris as JSON."),
    (Inventory, "List a small fruit inventory as JSON."),
])
def test_parse_returns_an_object_that_validates(client, model, question):
    reply = client.chat.completions.parse(model="smollm2", messages=ask(question), response_format=model,
                                          temperature=0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)
    model.model_validate_json(choice.message.content)       # the text itself validates, strictly
    assert choice.message.content == choice.message.content.strip()


def test_json_object_is_json(client):
    reply = client.chat.completions.create(model="smollm2", messages=ask("Return a JSON object with your name."),
                                           temperature=0, max_tokens=120, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_regex_and_choice_are_met_exactly(client):
    pattern = r"\d{3}-[A-Z]{2}"
    reply = client.completions.create(model="smollm2", prompt="A product code:", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
    options = ["positive", "negative", "neutral"]
    reply = client.chat.completions.create(model="smollm2", messages=ask("Is 'I love it' positive or negative?"),
                                           temperature=0, max_tokens=10,
                                           extra_body={"structured_outputs": {"choice": options}})
    assert reply.choices[0].message.content in options


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
    "additionalProperties": False}}}


def check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)
    return args


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_tool_call_has_arguments_that_validate(client, tool_choice):
    reply = client.chat.completions.create(model="smollm2", messages=ask("What is the weather in Paris?"),
                                           tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    for call in calls:
        if call.function.name == "get_weather":
            check_weather_args(call.function.arguments)
        else:
            assert set(json.loads(call.function.arguments)) == {"timezone"}


def whole_and_streamed(client, **request) -> tuple:
    whole = client.chat.completions.create(model="smollm2", temperature=0, **request).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="smollm2", temperature=0, stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    whole_calls = [{"name": c.function.name, "arguments": c.function.arguments}
                   for c in whole.message.tool_calls or ()]
    return (whole.message.content or "", whole_calls, whole.finish_reason), (content, list(calls.values()), finish)


@pytest.mark.parametrize("request_kind", ["schema", "named", "required", "auto"])
def test_streaming_gives_the_whole_reply(client, request_kind):
    request = {"messages": ask("What is the weather in Paris?"), "max_tokens": 80}
    if request_kind == "schema":
        request = {"messages": ask("Describe Paris as JSON."), "max_tokens": 120,
                   "response_format": {"type": "json_schema", "json_schema": {
                       "name": "city", "schema": City.model_json_schema()}}}
    elif request_kind == "named":
        request |= {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    else:
        request |= {"tools": [WEATHER, TIME], "tool_choice": request_kind}
    whole, streamed = whole_and_streamed(client, **request)
    assert streamed == whole


def test_constrained_and_free_requests_together_leave_the_free_text_unchanged(server, client):
    free = {"model": "smollm2", "messages": ask("What is the capital of France?"), "temperature": 0, "max_tokens": 24}
    alone = client.chat.completions.create(**free).choices[0].message.content

    async def together():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        constrained = [aclient.chat.completions.create(**free | {"response_format": {"type": "json_object"},
                                                                 "max_tokens": 40}) for _ in range(3)]
        return await asyncio.gather(aclient.chat.completions.create(**free), *constrained)

    replies = asyncio.run(together())
    assert replies[0].choices[0].message.content == alone


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "not": {"type": "string"}}}}}, "response_format.json_schema.schema", "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema", "frobnicate"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "send one"),
]


@pytest.mark.parametrize("extra, param, words", BAD)
def test_bad_constraints_are_400s_naming_the_field(server, extra, param, words):
    body = {"model": "smollm2", "messages": ask("hi"), "max_tokens": 4} | extra
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()
