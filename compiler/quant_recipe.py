"""The quantization recipe of a compile: what `--quant`, `--kv-dtype` and `--quant-embeddings` ask for.

  --quant none | int8 | int4 | int4-g32 | int4-g64 | int4-g128
      int8: symmetric, one scale per output channel; int4: asymmetric (scale and min) per group
      of 32, 64 or 128 inputs (int4 = int4-g32). Round to nearest. Formats: compiler/quant_format.py.
  --kv-dtype auto | int8     auto: the compute dtype; int8: codes + one fp32 scale per token per KV head
  --quant-embeddings / --no-quant-embeddings
                             the token embedding and the LM head as int8 (the default with a weight recipe,
                             int4 ones too: a GGUF's Q8_0 table is kept, anything else rounded per row), or
                             left in the compute dtype. Measured on SmolLM2-135M (README "Quantization"):
                             int8 codes cost the int4 recipe nothing there, int4 codes +5.8% perplexity,
                             above int4's 5% target, so the table is int8 whatever the recipe's width
  --requantize               round every weight from its float values, even where the source file's own
                             blocks already are of the recipe's width (a GGUF's Q8_0/Q4_0/Q4_1, kept by default)

The byte formulas here are the ones `llmc plan`, `llmc inspect` and the engine's KV sizing share.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from .quant_format import kv_row_width, weight_format

WEIGHT_RECIPES = ("none", "int8", "int4", "int4-g32", "int4-g64", "int4-g128")
KV_DTYPES = ("auto", "int8")
_INT4 = re.compile(r"int4(?:-g(\d+))?")


class QuantRecipeError(ValueError):
    """A quantization option that names no recipe; the message lists the ones there are."""


@dataclass(frozen=True)
class QuantRecipe:
    """bits: 0 (no weight quantization), 8 or 4; group_size: None is per output channel; embeddings:
    None is the default (int8 tables with a weight recipe, else float)."""

    bits: int = 0
    group_size: int | None = None
    kv_dtype: str = "auto"
    embeddings: bool | None = None
    requantize: bool = False

    def __post_init__(self) -> None:
        if self.embeddings is None:
            object.__setattr__(self, "embeddings", bool(self.bits))
        if self.kv_dtype not in KV_DTYPES:
            raise QuantRecipeError(f"--kv-dtype {self.kv_dtype!r} is unknown; choose one of {', '.join(KV_DTYPES)}")
        for flag, on in (("--quant-embeddings", self.embeddings), ("--requantize", self.requantize)):
            if on and not self.bits:
                raise QuantRecipeError(f"{flag} needs a weight recipe; add --quant int8 or --quant int4")

    @classmethod
    def parse(cls, quant: str = "none", kv_dtype: str = "auto", embeddings: bool | None = None,
              requantize: bool = False) -> "QuantRecipe":
        if quant not in WEIGHT_RECIPES:
            raise QuantRecipeError(f"--quant {quant!r} is unknown; choose one of {', '.join(WEIGHT_RECIPES)}")
        if quant == "none":
            return cls(0, None, kv_dtype, embeddings, requantize)
        if quant == "int8":
            return cls(8, None, kv_dtype, embeddings, requantize)
        group = _INT4.fullmatch(quant).group(1)
        return cls(4, int(group) if group else 32, kv_dtype, embeddings, requantize)

    @property
    def weights(self) -> str:
        """The recipe's name as `--quant` spells it."""
        return {0: "none", 8: "int8"}.get(self.bits, f"int4-g{self.group_size}")

    @property
    def embedding_recipe(self) -> "QuantRecipe":
        """How the token embedding and LM head quantize: int8 per row at any weight recipe's width."""
        return replace(self, bits=8, group_size=None)

    @property
    def active(self) -> bool:
        return bool(self.bits) or self.kv_dtype != "auto"

    def to_dict(self) -> dict:
        return {"weights": self.weights, **asdict(self)}


def quantized_weight_bytes(n: int, k: int, bits: int, group_size: int | None) -> int:
    """Bytes of an [N, K] weight as codes + fp16 scales (+ fp16 mins for int4)."""
    return weight_format(bits).stored_bytes(n, k, group_size or k)


def kv_row_bytes(head_dim: int, kv_dtype_bytes: int, int8: bool) -> int:
    """Bytes of one token's K (or V) for one KV head: int8 rows carry their fp32 scale."""
    return kv_row_width(head_dim, int8) if int8 else head_dim * kv_dtype_bytes
