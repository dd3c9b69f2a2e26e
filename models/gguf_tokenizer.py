"""Rebuild a Hugging Face `tokenizer.json` from the tokenizer a GGUF file carries in its metadata.

Two vocabulary kinds (`tokenizer.ggml.model`) are read: "llama", SentencePiece with byte fallback
(models/gguf_sentencepiece.py; BOS added unless `tokenizer.ggml.add_bos_token` says not, as llama.cpp
does), and "gpt2", byte-level BPE, whose pre-tokenizer follows `tokenizer.ggml.pre` the way llama.cpp
reads it, so ids match what llama.cpp would produce:

    pre                      pre-tokenizer
    gpt2 / default / absent  ByteLevel (GPT-2 regex)
    smollm                   Digits(individual) -> ByteLevel (GPT-2 regex)
    llama-bpe / llama3       Split(Llama-3 regex, isolated) -> ByteLevel (no regex); ignore_merges
    qwen2                    Split(Qwen2 regex, isolated) -> ByteLevel (no regex)

Token types (`tokenizer.ggml.token_type`): 3 = control -> special added token, 4 = user-defined ->
non-special added token, and for SentencePiece 2 = unknown (`<unk>`) -> special too (transformers'
`LlamaTokenizer` adds it); the rest (1 normal, 6 byte) are plain vocabulary.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .config import ModelError, TokenizerFiles
from .gguf_sentencepiece import sentencepiece_tokenizer

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE = ("gpt2", "default", "smollm", "llama-bpe", "llama3", "qwen2")
SUPPORTED_MODELS = ("gpt2", "llama")


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The Python value of metadata field `key` (str, number, bool or list), or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tokenizer_from_gguf(reader: GGUFReader) -> TokenizerFiles:
    """Build the Hugging Face tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    kind = gguf_value(reader, "tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ModelError(
            f"GGUF tokenizer model {kind!r} is not supported (llmc reads 'gpt2', byte-level BPE, and "
            "'llama', SentencePiece); load the model's Hugging Face folder instead"
        )
    tokens: list[str] | None = gguf_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError("GGUF file has no tokenizer.ggml.tokens; llmc needs the tokenizer in the file")
    spm = kind == "llama"
    tok = _sentencepiece(reader, tokens) if spm else _byte_level(reader, tokens)
    special = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) if spm else (TOKEN_TYPE_CONTROL,)
    _add_special_tokens(tok, tokens, gguf_value(reader, "tokenizer.ggml.token_type"), special)
    bos_id = gguf_value(reader, "tokenizer.ggml.bos_token_id")
    bos = _token_at(tokens, bos_id)
    eos = _token_at(tokens, gguf_value(reader, "tokenizer.ggml.eos_token_id"))
    add_bos = bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", spm))  # llama.cpp: SPM adds BOS
    if add_bos and bos is not None:
        tok.post_processor = _prepend_bos(bos, bos_id)
    return TokenizerFiles(
        tokenizer_json=tok.to_str(),
        chat_template=gguf_value(reader, "tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        add_bos_token=add_bos,
    )


def _byte_level(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    """Byte-level BPE ('gpt2') with the pre-tokenizer of `tokenizer.ggml.pre` (no special tokens yet)."""
    pre = gguf_value(reader, "tokenizer.ggml.pre", "default")
    tok = Tokenizer(_bpe_model(tokens, gguf_value(reader, "tokenizer.ggml.merges", []), pre))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    """SentencePiece ('llama') from tokens, scores (or merges) and add_space_prefix (no special tokens yet)."""
    unk_id = gguf_value(reader, "tokenizer.ggml.unknown_token_id")
    return sentencepiece_tokenizer(
        tokens, gguf_value(reader, "tokenizer.ggml.scores"), gguf_value(reader, "tokenizer.ggml.merges"),
        _token_at(tokens, unk_id), bool(gguf_value(reader, "tokenizer.ggml.add_space_prefix", True)),
    )


def _bpe_model(tokens: list[str], merges: list[str], pre: str) -> models.BPE:
    """Byte-level BPE over `tokens` (id = position) with merges given as 'left right' strings."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)  # as llama.cpp: the left part may itself start with a space
        if cut < 0:
            raise ModelError(f"GGUF merge {merge!r} has no space between its two parts; the file is corrupt")
        pairs.append((merge[:cut], merge[cut + 1:]))
    ignore_merges = pre in ("llama-bpe", "llama3")  # llama.cpp takes a whole word found in vocab as is
    return models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` == `pre`."""
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    regex = {"llama-bpe": LLAMA3_REGEX, "llama3": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}.get(pre)
    if regex is None:
        raise ModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; llmc knows {', '.join(SUPPORTED_PRE)} "
            "(load the model's Hugging Face folder instead)"
        )
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _add_special_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int] | None,
                        special: tuple[int, ...]) -> None:
    """Register tokens of the `special` types as special and user-defined tokens as plain added tokens."""
    if token_types is None:
        return
    if len(token_types) != len(tokens):
        raise ModelError(
            f"GGUF has {len(token_types)} token types for {len(tokens)} tokens; the file is corrupt"
        )
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind in special]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def _prepend_bos(bos: str, bos_id: int) -> processors.TemplateProcessing:
    """A post-processor that puts BOS in front of every sequence."""
    return processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)],
    )


def _token_at(tokens: list[str], token_id: int | None) -> str | None:
    """The token string for `token_id`, None when the id is absent."""
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelError(f"GGUF special token id {token_id} is outside the vocabulary of {len(tokens)}")
    return tokens[token_id]
