"""Load a GGUF file (llama.cpp's format) into a `LoadedModel`: config, fp32 weights, tokenizer.

Every tensor is dequantized to float32 with `gguf.quants.dequantize`; the types llmc reads (floats,
Q8_0/Q4_x/Q5_x, K-quants) are listed in models/gguf_blocks.py, any other is one ModelError.
Tensors stored as Q8_0, Q4_0
or Q4_1 are also kept as their codes and scales (`LoadedModel.quantized`, models/gguf_blocks.py),
for quantize_weights to keep bit for bit. GGUF stores shapes in ggml
order (fastest dimension first); the reader's arrays are already in numpy order.

llama.cpp's converter permutes the rows of Q and K (weight and bias) for the 'llama' architecture,
from Hugging Face's rotate-half layout to interleaved pairs. We undo it so the weights match the
Hugging Face layout that llmc's rotary embedding expects. Which architectures it permuted, and the
tensor names of each, are the family's (models/families): 'qwen2' files are not permuted.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from llmc.compiler.quant_format import QuantizedWeight

from .config import LoadedModel, ModelConfig, ModelError, TokenizerFiles, check_weights, expected_weights
from .families import family_for_gguf
from .families.family import Family
from .gguf_blocks import check_tensor_type, read_blocks
from .gguf_tokenizer import gguf_value, tokenizer_from_gguf
from .provenance import file_sha256

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def load_gguf(path: str | Path) -> LoadedModel:
    """Read a GGUF file: architecture and config from metadata, weights dequantized to fp32."""
    path = Path(path)
    reader = _open_reader(path)
    family = _family(reader)
    names = {t.name for t in reader.tensors}
    config = _read_config(reader, family, names)
    weights = _read_weights(reader, family)
    expected = expected_weights(config)
    family.split_fused(weights, expected)
    check_weights(config, weights, path.name, expected)
    quantized = _read_quantized(reader, family)
    family.split_fused(quantized, expected, lambda qw, start, stop: qw.rows(torch.arange(start, stop)))
    if family.gguf_permuted_qk:
        _unpermute_attention(weights, config)
        _unpermute_quantized(quantized, config)
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=_tokenizer(reader, family),
        source_files={path.name: file_sha256(path)},
        source_format="gguf",
        quantized=quantized,
    )


def _tokenizer(reader: GGUFReader, family: Family) -> TokenizerFiles:
    """The file's tokenizer; a file with no chat template gets its family's known one, said at INFO."""
    files = tokenizer_from_gguf(reader)
    if files.chat_template is None and family.chat_template is not None:
        log.info("the GGUF file has no chat template; using the %s family's known one", family.name)
        return dataclasses.replace(files, chat_template=family.chat_template)
    return files


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Only the architecture config of a GGUF file (metadata; no tensor data is read)."""
    reader = _open_reader(Path(path))
    return _read_config(reader, _family(reader), {t.name for t in reader.tensors})


def _open_reader(path: Path) -> GGUFReader:
    """Open `path` with gguf-py after checking that it exists and starts with the GGUF magic."""
    if not path.is_file():
        raise ModelError(f"GGUF file {str(path)!r} does not exist; check the path")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(
            f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
            "pass a .gguf file or a Hugging Face model folder"
        )
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError) as e:
        raise ModelError(f"GGUF file {str(path)!r} is truncated or corrupt ({e}); download it again") from e


def _family(reader: GGUFReader) -> Family:
    """The family that loads the file's `general.architecture` (ModelError naming them if none)."""
    return family_for_gguf(gguf_value(reader, "general.architecture"))


def _read_config(reader: GGUFReader, family: Family, tensor_names: set[str]) -> ModelConfig:
    """The family's `ModelConfig` from the `{arch}.*` and `tokenizer.ggml.*` metadata every GGUF
    decoder has (the family maps them, and may read more of `{arch}.*`)."""
    arch = family.gguf_architecture

    def value(key: str) -> Any:
        return gguf_value(reader, f"{arch}.{key}")

    def need(key: str) -> Any:
        value = gguf_value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = gguf_value(reader, f"{arch}.attention.key_length") \
        or gguf_value(reader, f"{arch}.rope.dimension_count") or hidden // heads
    vocab = gguf_value(reader, f"{arch}.vocab_size") or len(gguf_value(reader, "tokenizer.ggml.tokens", []))
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return family.gguf_config(dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf_value(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(gguf_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, tensor_names),
        max_position_embeddings=int(gguf_value(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    ), value)


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(reader: GGUFReader, arch: str, tensor_names: set[str]) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` in Hugging Face form ({"rope_type", "factor", ...}), or None."""
    kind = gguf_value(reader, f"{arch}.rope.scaling.type")
    if set(LONGROPE_FACTORS.values()) <= tensor_names:
        return _longrope_scaling(reader, arch)
    if kind in (None, "none"):
        if ROPE_FREQS in tensor_names:
            raise ModelError(
                "GGUF file scales RoPE through a rope_freqs tensor (Llama-3.1 style) without "
                "rope scaling metadata, which llmc cannot read; load the Hugging Face folder instead"
            )
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = gguf_value(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = _f32(factor)
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _longrope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """LongRoPE (Phi-3) as llama.cpp writes it: the two factor lists as tensors, the original context
    and the attention factor as metadata; in Hugging Face form (the family picks one list)."""
    tensors = {t.name: t for t in reader.tensors}
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, name in LONGROPE_FACTORS.items():
        scaling[key] = [_f32(v) for v in np.asarray(tensors[name].data, dtype=np.float32).ravel()]
    original = gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelError(f"GGUF metadata lacks {arch}.rope.scaling.original_context_length, which its LongRoPE "
                         "factors need; the file is incomplete")
    scaling["original_max_position_embeddings"] = int(original)
    if (attn := gguf_value(reader, f"{arch}.rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = _f32(attn)
    return scaling


def _read_weights(reader: GGUFReader, family: Family) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 under its canonical name (Q/K still as the file has them)."""
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name, family)
        if name is not None:
            weights[name] = torch.from_numpy(_dequantize(tensor))
    return weights


def _read_quantized(reader: GGUFReader, family: Family) -> dict[str, QuantizedWeight]:
    """The tensors stored in a format llmc keeps as it is (models/gguf_blocks.py), by canonical name."""
    kept = {}
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name, family)
        if name is not None and (blocks := read_blocks(tensor)) is not None:
            kept[name] = blocks
    return kept


def _unpermute_quantized(quantized: dict[str, QuantizedWeight], config: ModelConfig) -> None:
    """`_unpermute_attention` for kept blocks: the same permutation of Q/K rows (groups run along rows)."""
    for name, qw in quantized.items():
        if m := re.fullmatch(r"layers\.\d+\.(q|k)_proj\.weight", name):
            heads = config.num_heads if m.group(1) == "q" else config.num_kv_heads
            quantized[name] = qw.rows(torch.from_numpy(unpermute_qk(np.arange(qw.shape[0]), heads)))


def _unpermute_attention(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Undo the converter's Q/K row permutation in place (weights and biases, every layer)."""
    for name, w in weights.items():
        if re.fullmatch(r"layers\.\d+\.q_proj\.(weight|bias)", name):
            weights[name] = torch.from_numpy(unpermute_qk(w.numpy(), config.num_heads))
        elif re.fullmatch(r"layers\.\d+\.k_proj\.(weight|bias)", name):
            weights[name] = torch.from_numpy(unpermute_qk(w.numpy(), config.num_kv_heads))


def _canonical_name(gguf_name: str, family: Family) -> str | None:
    """llmc's name for GGUF tensor `gguf_name` of `family`; None for tensors llmc ignores (rope_freqs)."""
    if gguf_name == ROPE_FREQS or gguf_name in LONGROPE_FACTORS.values():
        return None  # the scaling it encodes is read from metadata (checked in _rope_scaling)
    if m := LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, suffix = m.groups()
        if part in family.gguf_layer_names:
            return f"layers.{layer}.{family.gguf_layer_names[part]}.{suffix}"
    elif m := GLOBAL_TENSOR.fullmatch(gguf_name):
        part, suffix = m.groups()
        if part in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[part]}.{suffix}"
    raise ModelError(
        f"GGUF tensor {gguf_name!r} is not part of a {family.name} decoder llmc knows; "
        "the file holds a variant llmc does not support"
    )


def _dequantize(tensor: Any) -> np.ndarray:
    """A `ReaderTensor` as a writable float32 array in numpy (row-major) order."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    check_tensor_type(tensor.name, qtype)  # every type it admits is one gguf-py dequantizes
    values = dequantize(tensor.data, qtype)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml order -> numpy order
    if values.dtype != np.float32 or not values.flags.writeable:  # F32 is a view of the read-only map
        values = np.array(values, dtype=np.float32)
    return values.reshape(shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> HF rotate-half halves).

    The converter did `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`;
    this reshapes to `[n_head, rows // n_head // 2, 2, *rest]` and swaps back.
    """
    rows, rest = w.shape[0], w.shape[1:]
    half = rows // n_head // 2
    if half * 2 * n_head != rows:
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    pairs = w.reshape(n_head, half, 2, *rest)  # [H, D/2, 2, ...]: the file's interleaved rows
    return pairs.swapaxes(1, 2).reshape(w.shape)  # [H, 2, D/2, ...]: first halves, then second
