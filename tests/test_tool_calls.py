"""Tool calls without a model (runtime/tool_calls.py, the chat reply in openai_responses.py): Hermes'
format writes and reads back, reading refuses anything but calls; bad tools and tool_choice are
RequestErrors naming the field; a streamed reply fed in pieces of any size reassembles to exactly
the whole reply (content, tool_calls, finish_reason); the prompt offers the tools through a
template that takes them, or in a system message for one that does not, with earlier calls and
tool results written as the format spells them."""

from __future__ import annotations

import copy
import json
import random

import pytest

from llmc.models.config import TokenizerFiles
from llmc.runtime.openai_responses import Choice, Reply
from llmc.runtime.request import RequestOutput
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.tool_calls import HERMES, chat_prompt, plan_tools
from tiny_models import byte_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALLS = [("get_weather", '{"city": "Paris, \\"la\\" Ville Lumière\\n"}'), ("get_time", "{}"),
         ("a.b-c_9", '{"n": [1, 2.5, null], "o": {"x": true}}')]


def test_the_format_reads_back_what_it_writes():
    for n in (1, 2, 3):
        assert HERMES.read(HERMES.write(CALLS[:n])) == CALLS[:n]


@pytest.mark.parametrize("text", [
    "", "Sure! " + HERMES.write(CALLS[:1]), HERMES.write(CALLS[:1]) + " done", "\n" + HERMES.write(CALLS[:1]),
    HERMES.write(CALLS[:1]).replace(HERMES.close, ""), '<tool_call>\n{"name": "f", "arguments": {}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>',
    HERMES.write(CALLS[:1]) + HERMES.write(CALLS[1:2]),                    # no separator between the calls
])
def test_reading_refuses_what_is_not_only_calls(text):
    assert HERMES.read(text) is None


@pytest.mark.parametrize("tools, tool_choice, param, word", [
    ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools[0].function.name", "name"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name", "has space"),
    ([{"type": "retrieval"}], "auto", "tools[0]", "function"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0].function.parameters",
     "schema"),
    ([WEATHER, WEATHER], "auto", "tools", "same name"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
    (None, "required", "tool_choice", "tools"),
    ([], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice", "tools"),
    ([WEATHER], "sometimes", "tool_choice", "sometimes"),
    ([WEATHER], ["auto"], "tool_choice", "auto"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, tool_choice, param, word):
    with pytest.raises(RequestError) as caught:
        plan_tools(tools, tool_choice, None)
    assert caught.value.param == param and word in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_plans_choose_the_mode_and_its_grammar():
    assert plan_tools(None, None, None) is None
    assert [plan_tools([WEATHER], choice, None).mode for choice in (None, "none", "auto", "required", NAMED)] == \
        ["auto", "none", "auto", "required", "named"]
    assert plan_tools([WEATHER], "none", None).grammar() is None and plan_tools([WEATHER], "none", None).offered == []
    named = plan_tools([WEATHER, TIME], NAMED, None)
    assert named.named.name == "get_weather" and json.loads(named.grammar().text) == WEATHER["function"]["parameters"]
    assert plan_tools([WEATHER], "required", None).grammar().kind == "grammar"


# ------------------------------------------------------------------------------ whole and streamed


def whole_reply(reply: Reply, text: str, finish_reason: str) -> tuple:
    choice = reply.response([Choice(0, 3, text=text, finish_reason=finish_reason)], [3])["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or ()]
    return choice["message"]["content"] or "", calls, choice["finish_reason"]


def streamed_reply(reply: Reply, text: str, finish_reason: str, rng: random.Random) -> tuple:
    """The chat chunks of `text` fed in random pieces (empty ones too: a held-back byte), reassembled
    as a client does: content joined, each tool call's name and arguments joined by its index."""
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, len(text) // 2)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    choice, content, calls, finish = Choice(0, 3), "", {}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput(0, [], piece, last, finish_reason if last else None)
        choice.add(out)
        delta = reply.chunk(choice, out, first=False)["choices"][0]
        content += delta["delta"].get("content") or ""
        for entry in delta["delta"].get("tool_calls") or ():
            call = calls.setdefault(entry["index"], {"name": "", "arguments": "", "ids": []})
            call["ids"] += [entry["id"]] if "id" in entry else []
            call["name"] += entry["function"].get("name") or ""
            call["arguments"] += entry["function"].get("arguments") or ""
        finish = delta["finish_reason"] or finish
    assert all(len(c["ids"]) == 1 and c["ids"][0].startswith("call_") for c in calls.values())
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


ARGS = '{"city": "Paris"}'
REPLIES = [
    ("named", NAMED, ARGS, "stop", ("", [("get_weather", ARGS)], "tool_calls")),
    ("required", "required", HERMES.write(CALLS[:2]), "stop", ("", CALLS[:2], "tool_calls")),
    ("auto-call", "auto", HERMES.write(CALLS[1:3]), "stop", ("", CALLS[1:3], "tool_calls")),
    ("auto-text", "auto", "It is sunny in Paris, <b>21 °C</b> 🎉", "stop", None),
    ("auto-text-like-a-call", "auto", "<tool_calls are not mine>", "stop", None),
    ("auto-space-then-call", "auto", "\n" + HERMES.write(CALLS[:1]), "stop", None),   # text, as the grammar read it
    ("required-cut", "required", HERMES.write(CALLS[:1]), "length", None),   # max_tokens right at the close: text
    ("none", "none", "Just text <tool_call>", "stop", None),
]


@pytest.mark.parametrize("tool_choice, text, finish_reason, expected", [r[1:] for r in REPLIES],
                         ids=[r[0] for r in REPLIES])
def test_streamed_deltas_reassemble_to_the_whole_reply(tool_choice, text, finish_reason, expected):
    plan = plan_tools([WEATHER, TIME, {"type": "function", "function": {"name": "a.b-c_9"}}], tool_choice, None)
    reply = Reply(True, "m", Tokenizer(TokenizerFiles(byte_tokenizer().to_str(), None)), tools=plan)
    whole = whole_reply(reply, text, finish_reason)
    assert whole == (expected or (text, [], finish_reason))
    for seed in range(24):
        assert streamed_reply(reply, text, finish_reason, random.Random(seed)) == whole, seed


# ---------------------------------------------------------------------------------- the prompt


PLAIN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
TAKES_TOOLS = ("{% if tools %}[tools] {{ tools | tojson }}|{% endif %}{% for m in messages %}[{{ m.role }}] "
               "{{ m.content }}{% for c in m.tool_calls or [] %}<call {{ c.function.name }} "
               "{{ c.function.arguments | tojson }}>{% endfor %}|{% endfor %}[assistant] ")
CALL_ENTRY = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL_ENTRY]},
                {"role": "tool", "content": "18 °C", "tool_call_id": "call_1"}]


def prompt_text(template: str, messages: list[dict], tool_choice) -> str:
    tokenizer = Tokenizer(TokenizerFiles(byte_tokenizer().to_str(), template))
    given = copy.deepcopy(messages)
    text = tokenizer.decode(chat_prompt(tokenizer, given, plan_tools([WEATHER], tool_choice, template)))
    assert given == messages                                       # the caller's messages are left as they were
    assert tokenizer.decode(chat_prompt(tokenizer, given, plan_tools([WEATHER], tool_choice, template))) == text
    return text


def test_a_template_without_tools_gets_them_in_the_system_message():
    text = prompt_text(PLAIN, CONVERSATION, "auto")
    system = text.split("\n[user]")[0]
    assert system.startswith("[system] Be brief.\n\n# Tools") and text.count("[system]") == 1
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == WEATHER and HERMES.open in system
    assert f"[assistant] {HERMES.write([('get_weather', ARGS)])}\n" in text             # the earlier call
    assert f"[user] {HERMES.result_open}18 °C{HERMES.result_close}\n" in text            # its result
    alone = prompt_text(PLAIN, CONVERSATION[1:2], "auto")
    assert alone.startswith("[system] # Tools") and alone.endswith("[user] Weather in Paris?\n[assistant] ")
    assert "# Tools" not in prompt_text(PLAIN, CONVERSATION, "none")


def test_a_template_that_takes_tools_renders_them_itself():
    tools, *turns = prompt_text(TAKES_TOOLS, CONVERSATION, "auto").split("|")
    assert json.loads(tools.removeprefix("[tools] ")) == [WEATHER]
    assert turns == ["[system] Be brief.", "[user] Weather in Paris?",
                     f"[assistant] <call get_weather {ARGS}>",                  # arguments given as an object
                     "[tool] 18 °C", "[assistant] "]
    assert "[tools]" not in prompt_text(TAKES_TOOLS, CONVERSATION, "none")
