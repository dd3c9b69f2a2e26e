"""Grammar constraints for structured output (DESIGN decision 14), on llguidance.

A request's constraint is a `GrammarSpec`: a JSON schema, a regular expression, a choice among
strings, or a Lark / GBNF grammar. The engine's `GrammarCompiler` turns a spec into a
`GrammarMatcher`, the per-request state that gives, before every sampled token, the set of tokens
the grammar allows next as a bitmask (vocabulary / 32 int32 words, bit t % 32 of word t // 32 set
when token t is allowed; the sampler applies it before anything else) and advances with every
accepted token. The compiler validates and builds each distinct grammar once (an LRU cache keyed by
its text) and hands every request a copy of the built matcher, so the build's cost is paid once and
outside the engine loop: callers prepare requests in their own thread (`Engine.prepare`).

Why llguidance (not XGrammar): one small wheel with no dependencies (XGrammar pulls transformers
and a torch build of its own), it refuses schema keywords it cannot enforce instead of ignoring
them (an unsupported feature becomes a 400 naming it), its mask costs ~10-20 us a row on a 49k
vocabulary, and its matcher rolls back (for speculative decoding).

JSON is generated compact and in one spelling, `{"a": 1, "b": [2, 3]}` (", " between items, ": "
after keys, no other whitespace): free whitespace lets a small model loop on newlines forever.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from .sampling_params import RequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "grammar")


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to.

    kind   "json_schema" (text: the schema as JSON), "regex" (Rust regex syntax, with ASCII \\d and
           \\w as in JSON Schema), "choice" (text: a JSON list of strings) or "grammar" (Lark, or
           llama.cpp's GBNF)
    param  the request field it came from, named in errors
    """

    kind: str
    text: str
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise RequestError(f"grammar kind {self.kind!r} is unknown; use one of {', '.join(GRAMMAR_KINDS)}",
                               self.param)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> "GrammarSpec":
        """A JSON schema (a dict, or a bool), as compact text: schemas sent alike share a cache entry
        (keys keep their order: a schema's property order is the order they are generated in)."""
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{param} must be a JSON schema object", param)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, options: list[str], param: str) -> "GrammarSpec":
        if not options or not all(isinstance(o, str) and o for o in options):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(options), param)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format; RequestError when the text cannot be read."""
        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
            if self.kind == "regex":        # \\d, \\w: ASCII, as in JSON Schema and JavaScript
                return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(self.text, 'dw')}/")
            if self.kind == "choice":
                lark = "start: " + " | ".join(json.dumps(o) for o in json.loads(self.text))
                return llguidance.LLMatcher.grammar_from_lark(lark)
            return llguidance.grammar_from("grammar", self.text)
        except ValueError as exc:
            kind = self.kind.replace("_", " ")
            raise RequestError(f"{self.param} is not a valid {kind}: {exc}", self.param) from None


class GrammarMatcher:
    """One request's grammar state: the allowed next tokens, advanced by each accepted token."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: GrammarSpec):
        self.matcher = matcher
        self.spec = spec

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 CPU bitmask [rows, words]."""
        target = bitmask[row]
        assert bitmask.dtype == torch.int32 and target.is_contiguous()
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def bitmasks_along(self, draft_ids: list[int], words: int) -> torch.Tensor:
        """int32 [K+1, words] for a speculative verify step: row i the tokens allowed after the drafts
        before it. Rows past the first draft the grammar refuses (verification stops there) and rows
        past the grammar's end (the request ends there) allow every token. The state is unchanged."""
        bitmask = torch.full((len(draft_ids) + 1, words), -1, dtype=torch.int32)
        valid = self.matcher.validate_tokens(draft_ids)
        for i in range(valid + 1):
            if self.matcher.is_stopped():
                break
            self.fill_bitmask(bitmask, i)
            if i < valid:
                self.matcher.consume_token(draft_ids[i])
        self.rollback(min(i, valid))
        return bitmask

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and `error` set) if the grammar did not allow it."""
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: {self.matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows no further token (its EOS included)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCompiler:
    """Builds matchers for one tokenizer, caching each distinct grammar's built matcher (LRU).

    Thread-safe: any number of caller threads may ask at once; a grammar is built (and checked)
    in the asking thread, never in the engine loop."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 128):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None     # fills many rows' masks in parallel
        self._built: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, made on first use (~0.2 s for 49k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            return self._tokenizer

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar; RequestError naming the field when the
        grammar is invalid or uses something that cannot be enforced."""
        with self._lock:
            built = self._built.get(spec)
            if built is not None:
                self._built.move_to_end(spec)
                return GrammarMatcher(built.deep_copy(), spec)
        built = self._build(spec)
        with self._lock:
            self._built[spec] = built
            while len(self._built) > self.cache_size:
                self._built.popitem(last=False)
        return GrammarMatcher(built.deep_copy(), spec)

    def next_token_bitmasks(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """int32 [len(matchers), words]: row i the tokens matcher i allows next (engine loop only)."""
        bitmask = torch.empty(len(matchers), bitmask_words(self.vocab_size), dtype=torch.int32)
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, 0)
            return bitmask
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
        return bitmask

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        grammar, tokenizer = spec.llguidance_grammar(), self.tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:         # a warning is a keyword the grammar would not enforce
            raise RequestError(f"{spec.param} cannot be enforced: {_first_line(messages)}", spec.param)
        built = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if built.is_error():
            raise RequestError(f"{spec.param} cannot be enforced: {_first_line([built.get_error()])}", spec.param)
        return built


def _first_line(messages: list[str]) -> str:
    """The library's reason in one line: its first line, and the parser's own `error:` line if any."""
    lines = (messages[0] if messages else "the grammar library gave no reason").strip().splitlines()
    detail = next((line.strip() for line in lines[1:] if line.strip().startswith("error:")), None)
    return f"{lines[0]} ({detail})" if detail else lines[0]
