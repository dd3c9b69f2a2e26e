"""GGUF tensors whose blocks already are one of llmc's weight formats, read without dequantizing.

llama.cpp's Q8_0, Q4_0 and Q4_1 blocks hold 32 weights of one row (ggml-common.h):
  Q8_0  fp16 d, 32 int8 q                      w = d * q
  Q4_0  fp16 d, 16 bytes of 4-bit q            w = d * (q - 8)
  Q4_1  fp16 d, fp16 m, 16 bytes of 4-bit q    w = d * q + m
with byte j of the 16 holding weight j in its low nibble and weight j + 16 in its high one, the
order of llmc's int4 format (compiler/quant_format.py). So Q8_0 is int8 with groups of 32, Q4_1
is int4-g32 as it stands, and Q4_0 is int4-g32 with min = -8d (exact in fp16 and in the fp32
dequantization).

Which GGUF tensor types llmc reads, and how (READ_TYPES; any other type is one ModelError):
  kept as codes   Q8_0, Q4_0, Q4_1: llmc has kernels for these formats, so the file's codes and
                  scales go to the artifact as they are (read_blocks)
  dequantized     F32, F16, BF16, and Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: no kernel reads
                  the 5-bit or K-quant blocks yet, so they load as the fp32 weights gguf-py's
                  dequantize gives, which --quant may re-quantize to one of llmc's formats
Every tensor, kept or not, is also dequantized to fp32 (models/gguf_loader.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from llmc.compiler.quant_format import QuantizedWeight

from .config import ModelError

BLOCK = 32
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
READ_TYPES = KEPT_TYPES + DEQUANTIZED_TYPES


def check_tensor_type(name: str, qtype: GGMLQuantizationType) -> None:
    """Raise a one-sentence ModelError naming tensor `name`, its type and READ_TYPES unless llmc reads it."""
    if qtype.name not in READ_TYPES:
        raise ModelError(
            f"GGUF tensor {name!r} has type {qtype.name}, which llmc does not read (it reads "
            f"{', '.join(READ_TYPES)}); re-quantize the model to one of those types"
        )


def read_blocks(tensor: Any) -> QuantizedWeight | None:
    """The codes and scales of a 2-D Q8_0/Q4_0/Q4_1 `ReaderTensor` as stored; None for other types."""
    qtype = GGMLQuantizationType(tensor.tensor_type).name
    if qtype not in KEPT_TYPES or len(tensor.shape) != 2:
        return None
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])          # ggml order: fastest dim first
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // BLOCK, -1)
    d = _f16(blocks[..., 0:2])
    if qtype == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols))
        return QuantizedWeight(8, BLOCK, codes, d, None, qtype)
    if qtype == "Q4_1":
        mins, nibbles = _f16(blocks[..., 2:4]), blocks[..., 4:]
    else:
        mins, nibbles = (d.float() * -8).to(torch.float16), blocks[..., 2:]
    codes = torch.from_numpy(nibbles.copy().reshape(rows, cols // 2))
    return QuantizedWeight(4, BLOCK, codes, d, mins, qtype)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 2] bytes -> fp16 [rows, blocks]."""
    return torch.from_numpy(raw.copy().view(np.float16)[..., 0])
