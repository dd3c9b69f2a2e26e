"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE.

llama.cpp's SPM tokenizer starts from the UTF-8 characters of the text (spaces written as U+2581
'▁', one '▁' put in front of the text when `tokenizer.ggml.add_space_prefix`, default true), then
repeatedly joins the adjacent pair whose join is a token with the highest score; a character no
token spells becomes its UTF-8 bytes as the `<0xNN>` tokens. That is BPE with byte fallback whose
merges are every split of a token into two tokens, ranked by the token's score, which is how
transformers' `LlamaTokenizer` reads a SentencePiece model (`generate_merges`), so:

    model          BPE(vocab, merges, byte_fallback, fuse_unk); merges from the file if it has them,
                   else from scores (best first; ties: longer left part, then longer right part,
                   then vocabulary order, as transformers breaks them)
    normalizer     none
    pre-tokenizer  Metaspace('▁', prepend_scheme "first" (only before the text's first piece, not
                   after a special token) or "never" without add_space_prefix, no split)
    decoder        '▁' -> ' ', ByteFallback, Fuse, and Strip the one prefix space we added
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .config import ModelError

SPACE = "\u2581"


def sentencepiece_tokenizer(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                            unk: str | None, add_space_prefix: bool) -> Tokenizer:
    """The BPE-with-byte-fallback `Tokenizer` llama.cpp's SPM vocabulary describes (no special tokens yet)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if merges:
        pairs = [_split_merge(m) for m in merges]
    elif scores is None or len(scores) != len(tokens):
        raise ModelError(
            f"GGUF SentencePiece vocabulary of {len(tokens)} tokens has "
            f"{'no' if scores is None else len(scores)} tokenizer.ggml.scores and no merges; the file is corrupt"
        )
    else:
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    scheme = "first" if add_space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best token score first (transformers' order)."""
    ranked = []
    for token, score in scores.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked += [(score, left, right) for left, right in splits]
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep order
    return [(left, right) for _, left, right in ranked]


def _split_merge(merge: str) -> tuple[str, str]:
    """'left right' -> (left, right); SentencePiece pieces hold no plain space."""
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ModelError(f"GGUF merge {merge!r} is not two parts split by one space; the file is corrupt")
    return left, right
