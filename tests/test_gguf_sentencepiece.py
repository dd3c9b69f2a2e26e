"""A SentencePiece vocabulary (`tokenizer.ggml.model` = "llama": scores, token types, `<0xNN>` byte
tokens, '▁' for spaces, BOS) written into a GGUF's metadata with gguf-py, rebuilt by llmc, tokenizes
and decodes a corpus of hard strings exactly as transformers' tokenizer read from the same file does.

The vocabulary is a tiny BPE trained here with `tokenizers` on a few sentences, laid out as a
SentencePiece model is: specials, the 256 byte tokens, merged pieces (score -rank), single
characters (lowest scores), one user-defined token."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf import GGUFReader
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from llmc.models.config import ModelError
from llmc.models.gguf_sentencepiece import merges_from_scores
from llmc.models.gguf_tokenizer import tokenizer_from_gguf

SPACE = "\u2581"
TRAINING = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tokenizer!",
            "café naïve résumé", "the theory of everything is there", "你好世界 你好"] * 3
SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
USER = "<|tool|>"
HARD = [
    "Hello world", " Hello world", "Hello  world", "   leading spaces", "trailing spaces   ",
    "tabs\tand\t\ttabs", "new\nlines\n\nhere\n", "\n", " ", "", "a\r\nb",
    "café naïve résumé", "Ünïcödé ÅÉÎ façade", "你好世界", "日本語のテキスト", "emoji 😀🎉 👍🏽!",
    "mixed 你好 and 😀 here", "zzqq ✓ ∑ 𝔘 \u00a0nbsp \x00ctrl", "the theory", "Thethe  the   the",
    "<s>special</s> <unk> x", f"{USER}call {USER} and text",
]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a tiny SentencePiece-style BPE vocabulary."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    trained.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    merged = [m.replace(" ", "") if isinstance(m, str) else "".join(m) for m in model["merges"]]
    chars = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    scores, types = [0.0] * len(tokens), [k for _, k in SPECIALS] + [6] * 256
    for rank, piece in enumerate(dict.fromkeys(merged + chars)):
        tokens.append(piece)
        scores.append(-float(rank) if rank < len(merged) else -1000.0 - rank)
        types.append(1)
    return tokens + [USER], scores + [0.0], types + [4]


def write_spm_gguf(path: Path, **meta) -> Path:
    """A GGUF holding only llama hyperparameters and the SentencePiece tokenizer metadata."""
    tokens, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 64),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4)]:
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(meta.get("model", "llama"))
    w.add_token_list(tokens)
    if meta.get("scores", True):
        w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    """(llmc's tokenizer, transformers' tokenizer) both read from one SentencePiece GGUF."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("spm")
    path = write_spm_gguf(folder / "spm.gguf")
    files = tokenizer_from_gguf(GGUFReader(path))
    assert (files.bos_token, files.eos_token, files.add_bos_token) == ("<s>", "</s>", True)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    return Tokenizer.from_str(files.tokenizer_json), hf


@pytest.mark.parametrize("text", HARD, ids=range(len(HARD)))
def test_ids_and_decoding_match_transformers(tokenizers_pair, text):
    ours, hf = tokenizers_pair
    ids = ours.encode(text).ids
    assert ids == hf(text)["input_ids"]
    assert ids[0] == 1  # BOS: llama.cpp adds it to a SentencePiece vocabulary by default
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in ("<s>", "</s>", "<unk>")):  # round trip, but as transformers does:
        # Metaspace adds no '▁' before text that starts with a space, and decoding strips one
        assert ours.decode(ids, skip_special_tokens=True) == text.removeprefix(" ")


def test_corpus_exercises_byte_fallback_spaces_and_specials(tokenizers_pair):
    """A near miss would show: the corpus really hits byte tokens, runs of '▁' and whole specials."""
    ours, _ = tokenizers_pair
    assert "<0xF0>" in ours.encode("emoji 😀").tokens and "<0x09>" in ours.encode("a\tb").tokens
    assert ours.encode("   x").tokens == ["<s>", SPACE, SPACE, SPACE, "x"]  # no '▁▁' token in this vocab
    assert ours.encode("Hello  world").tokens[1:4] == [SPACE + "Hello", SPACE, SPACE + "wor"]
    assert ours.encode("a <unk> b").tokens.count("<unk>") == 1
    assert ours.encode(f"x{USER}y").tokens.count(USER) == 1


def test_merges_rank_by_score_of_the_joined_token():
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc"])}
    scores = {"ab": -2.0, "bc": -1.0, "abc": -3.0}
    assert merges_from_scores(vocab, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_missing_scores_and_unknown_model_are_one_sentence(tmp_path):
    with pytest.raises(ModelError, match=r"has no tokenizer.ggml.scores and no merges; the file is corrupt"):
        tokenizer_from_gguf(GGUFReader(write_spm_gguf(tmp_path / "a.gguf", scores=False)))
    with pytest.raises(ModelError, match=r"tokenizer model 't5' is not supported.*'gpt2'.*'llama'"):
        tokenizer_from_gguf(GGUFReader(write_spm_gguf(tmp_path / "b.gguf", model="t5")))
