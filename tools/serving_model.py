"""The model `llmc profile --serving` measures host time on, and the SmolLM2-135M shapes its floor is for.

An engine step's host work (scheduling, input building, sampling, commit, detokenisation) depends on
the batch, the context and the vocabulary, not on the model's width. So the profile serves a tiny
random-weight Llama with SmolLM2-135M's vocabulary (49152), context (8192) and tokenizer (rebuilt
from the embedded GGUF; a plain word-level tokenizer of the same size where that is not installed),
and one layer of two heads over one KV head of 32: its compute is small and its KV cache fits in
megabytes, while every host phase does the work it does for SmolLM2.

The time a SmolLM2-135M decode step must take at least is its memory floor: the bytes it must read
(every weight once, one embedding row per sequence, and every sequence's K/V) over the read bandwidth.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from llmc.compiler.driver import compile_model
from llmc.models.config import ModelConfig, ModelError, TokenizerFiles, expected_weights
from llmc.runtime.artifact import Artifact, load_artifact
from llmc.runtime.memory_plan import kv_bytes_per_token

from .gpu_check_model import hf_config, write_random_model, write_tokenizer

FLOOR_DTYPE, FLOOR_BYTES = "float32", 4      # the dtype of the floor's weights and K/V: llmc's default compile
TINY_SHAPES = dict(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=32)


def smollm2_135m() -> ModelConfig:
    """SmolLM2-135M-Instruct's architecture, as the embedded GGUF gives it (tests check the two agree)."""
    return ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))


def serving_tokenizer(vocab_size: int) -> tuple[TokenizerFiles, str]:
    """SmolLM2's tokenizer from the embedded GGUF, or a word-level one of `vocab_size` tokens where the
    GGUF is not installed; and a note saying which."""
    from gguf import GGUFReader

    from llmc.models.embedded import embedded_model_path
    from llmc.models.gguf_tokenizer import tokenizer_from_gguf
    try:
        return tokenizer_from_gguf(GGUFReader(embedded_model_path())), "SmolLM2-135M's tokenizer"
    except ModelError:
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
        return (TokenizerFiles(tok.to_str(), None, eos_token="t2"),
                f"a word-level tokenizer of {vocab_size} tokens (the embedded SmolLM2 is not installed)")


def tiny_serving_model(folder: Path, seed: int = 0) -> tuple[Artifact, str]:
    """Write, compile and load the tiny model (module docstring) under `folder`; the artifact and a
    note naming its tokenizer."""
    cfg = dataclasses.replace(smollm2_135m(), **TINY_SHAPES)
    bundle = folder / "bundle"
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    files, note = serving_tokenizer(cfg.vocab_size)
    write_tokenizer(files, bundle)
    compile_model(write_random_model(bundle, folder / "hf", seed), folder / "artifact")
    return load_artifact(folder / "artifact"), note


def describe_shapes(cfg: ModelConfig) -> str:
    return (f"{cfg.num_layers} layer{'s' * (cfg.num_layers != 1)}, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
            f"{cfg.num_kv_heads} KV head{'s' * (cfg.num_kv_heads != 1)} of {cfg.head_dim}, vocabulary {cfg.vocab_size}")


def weight_bytes_read(cfg: ModelConfig, batch: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads: every weight once, but of the embedding
    table only a row per sequence (a tied table is read whole as the LM head)."""
    params = sum(math.prod(shape) for shape in expected_weights(cfg).values())
    table = cfg.vocab_size * cfg.hidden_size
    return FLOOR_BYTES * (params - (0 if cfg.tie_word_embeddings else table) + batch * cfg.hidden_size)


def decode_floor_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences of `context` tokens each must read: weights and K/V."""
    return weight_bytes_read(cfg, batch) + batch * context * kv_bytes_per_token(cfg, FLOOR_DTYPE)
