"""Tokenizer, chat template and incremental detokenizer for an artifact.

The chat template is a Hugging Face Jinja template, rendered the way transformers renders it
(sandboxed, trim_blocks + lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a
non-escaping `tojson`, `add_generation_prompt`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from llmc.models.config import TokenizerFiles

from .sampling_params import RequestError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spelling: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _template_environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers renders chat templates: sandboxed, trim_blocks + lstrip_blocks, loop
    controls, `raise_exception` and `strftime_now`, and a `tojson` that keeps non-ASCII text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env


class Tokenizer:
    def __init__(self, files: TokenizerFiles):
        self.files = files
        self._tok = HFTokenizer.from_str(files.tokenizer_json)
        decoder = (json.loads(files.tokenizer_json).get("decoder") or {}).get("type")
        self._byte_chars = _byte_level_alphabet() if decoder == "ByteLevel" else None
        self._template = None
        if files.chat_template:
            self._template = _template_environment().from_string(files.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (as transformers passes it)."""
        return bool(self.files.chat_template) and "tools" in self.files.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a character)."""
        piece = self._tok.id_to_token(token_id) or ""
        if self._byte_chars is not None and piece and all(c in self._byte_chars for c in piece):
            return bytes(self._byte_chars[c] for c in piece)
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token as OpenAI's logprobs name it: its text, or `bytes:\\xNN...` for part of a character."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render chat messages (and, for a template that takes them, OpenAI-style tools) to the
        prompt text the model was trained on."""
        if self._template is None:
            raise RequestError("this model has no chat template; send a plain prompt (--no-chat)")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         bos_token=self.files.bos_token or "",
                                         eos_token=self.files.eos_token or "")
        except TemplateError as exc:
            raise RequestError(f"the chat template rejected these messages: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat; the template already holds any BOS text."""
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Text is decoded from a window that starts a few tokens before the unseen ones (enough
    context for byte-level merges and leading-space rules); a delta that ends in U+FFFD (an
    incomplete multi-byte character) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, context: int = 5):
        self.tokenizer = tokenizer
        self.ids: list[int] = list((prompt_ids or [])[-context:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of the output: the held-back text, an unfinished character as U+FFFD."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
