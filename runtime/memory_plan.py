"""KV cache sizing: how many tokens of cache fit in what the weights leave of a memory budget.

    KV bytes per token = 2 (K and V) x layers x kv_heads x row bytes, where a row is
                         head_dim x bytes per element (int8: head_dim codes + a 4-byte scale)
    weight bytes       = every tensor at its dtype's bytes; with int8/int4 the GEMM weights are
                         codes + fp16 scales (+ fp16 mins for int4, groups of 32), the embedding
                         and LM head int8 codes + an fp16 scale a row (compile's default: see
                         compiler/quant_recipe.py), and the norms 2 bytes (fp16/bf16)
    kv_tokens          = (memory - weight bytes) // KV bytes per token
    max_sequences      = kv_tokens // context

Sliding-window layers (Gemma, Mistral, Phi-3) keep every token's K and V like the others: the paged
cache is one pool of blocks shared by all layers, so a token's row of every layer is counted;
`sliding_layers` says how many of the layers only read their window of it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from llmc.compiler.dtypes import USER_DTYPES, dtype_info
from llmc.compiler.quant_recipe import kv_row_bytes, quantized_weight_bytes
from llmc.models.config import ModelConfig, expected_weights

from .sampling_params import RequestError

BYTES_PER_ELEMENT = {user: dtype_info(ir).element_size for user, ir in USER_DTYPES.items()}
QUANT_BITS = {"int8": 8, "int4": 4}
EMBEDDING_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '512MB' -> 512000000, '1000' -> 1000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise RequestError(f"memory size {text!r} is not understood; write it like 80GiB, 16GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _element_bytes(dtype: str, what: str) -> int:
    if dtype not in BYTES_PER_ELEMENT:
        choices = [*BYTES_PER_ELEMENT, *(QUANT_BITS if what == "weight dtype" else ("int8",))]
        raise RequestError(f"{what} {dtype!r} is not supported; choose one of {', '.join(choices)}")
    return BYTES_PER_ELEMENT[dtype]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def num_parameters(cfg: ModelConfig) -> int:
    return sum(_numel(shape) for shape in expected_weights(cfg).values())


def weight_bytes(cfg: ModelConfig, weight_dtype: str) -> int:
    """Bytes of every weight stored as `weight_dtype` (a float dtype, int8 or int4; see module doc)."""
    if weight_dtype not in QUANT_BITS:
        return num_parameters(cfg) * _element_bytes(weight_dtype, "weight dtype")
    total = 0
    for name, shape in expected_weights(cfg).items():
        if len(shape) == 2:
            bits = 8 if name in EMBEDDING_WEIGHTS else QUANT_BITS[weight_dtype]
            total += quantized_weight_bytes(*shape, bits, 32 if bits == 4 else None)
        else:
            total += 2 * _numel(shape)
    return total


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    if kv_dtype == "int8":
        row = kv_row_bytes(cfg.head_dim, 1, int8=True)
    else:
        row = kv_row_bytes(cfg.head_dim, _element_bytes(kv_dtype, "kv dtype"), int8=False)
    return 2 * cfg.num_layers * cfg.num_kv_heads * row


@dataclass(frozen=True)
class MemoryPlan:
    memory_bytes: int
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    context: int
    max_sequences: int
    sliding_layers: int = 0          # of the layers, those that attend within a window (all keep every token)
    sliding_window: int | None = None

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def plan_memory(cfg: ModelConfig, memory_bytes: int, weight_dtype: str = "float16",
                kv_dtype: str = "float16", context: int | None = None) -> MemoryPlan:
    """Weights, KV bytes per token, and how many tokens / sequences the rest holds."""
    context = context or cfg.max_position_embeddings
    if context <= 0:
        raise RequestError(f"context={context} must be positive")
    params = num_parameters(cfg)
    weights = weight_bytes(cfg, weight_dtype)
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    if weights >= memory_bytes:
        raise RequestError(f"the weights alone take {weights} bytes, more than the {memory_bytes} "
                           "bytes of memory given; give more memory or a smaller weight dtype")
    kv_tokens = (memory_bytes - weights) // per_token
    sliding = sum(cfg.is_sliding(i) for i in range(cfg.num_layers))
    return MemoryPlan(memory_bytes, params, weights, per_token, kv_tokens, context, kv_tokens // context,
                      sliding, cfg.sliding_window if sliding else None)
