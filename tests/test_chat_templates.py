"""Chat templates render as transformers renders them: each family's known template (what a GGUF
without one gets) and a template using what newer ones use (namespace, loop controls, tojson,
strftime_now), through llmc's Tokenizer and through transformers' apply_chat_template."""

from __future__ import annotations

import pytest
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerFast

from llmc.models.config import TokenizerFiles
from llmc.models.families import FAMILIES
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.tokenizer import Tokenizer
from tiny_models import byte_tokenizer

# The features Qwen3's and Llama 3's templates lean on, in a few lines.
MODERN = ("{%- set ns = namespace(last_user=0) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
          "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
          "{%- for m in messages -%}{%- if m.role == 'tool' -%}{%- continue -%}{%- endif -%}"
          "<|{{ m.role }}|>{{ m.content | trim }}{% if loop.index0 == ns.last_user %}{{ {'é': [1, 2]} | tojson }}{% endif %}\n"
          "{%- if loop.index0 > 5 -%}{%- break -%}{%- endif -%}{%- endfor -%}"
          "{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CHATS = {
    "user": [{"role": "user", "content": "Héllo, 世界! 👋"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Why?\t\n"}],
    "turns": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
              {"role": "tool", "content": "c"}, {"role": "user", "content": "d"}],
}
TEMPLATES = {f"{name}-known": f.chat_template for name, f in FAMILIES.items() if f.chat_template} | {"modern": MODERN}


def transformers_render(template: str, chat: list[dict]) -> str | type:
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>")
    try:
        return tok.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        return TemplateError


def llmc_render(template: str, chat: list[dict]) -> str | type:
    files = TokenizerFiles(byte_tokenizer().to_str(), template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    try:
        return Tokenizer(files).apply_chat_template(chat)
    except RequestError:
        return TemplateError


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_templates_render_as_transformers_renders_them(template, chat):
    want = transformers_render(TEMPLATES[template], CHATS[chat])
    assert llmc_render(TEMPLATES[template], CHATS[chat]) == want


def test_a_template_that_refuses_a_chat_is_a_request_error_as_in_transformers():
    """Gemma's refuse a system turn (Gemma 2) and turns that do not alternate (both)."""
    for name, chat in (("gemma2-known", "system"), ("gemma3-known", "turns")):
        assert transformers_render(TEMPLATES[name], CHATS[chat]) is TemplateError
        assert llmc_render(TEMPLATES[name], CHATS[chat]) is TemplateError


def test_the_known_templates_cover_the_new_families():
    assert {n for n, f in FAMILIES.items() if f.chat_template} == {"qwen3", "gemma2", "gemma3", "phi3", "olmo2"}
