"""Quantized weights and the int8 KV cache: the formats, how to make them, what they mean.

Weights (read by `qlinear` and `qembedding`) are row-major [N, K], in groups of G consecutive
inputs of a row, each group with its own fp16 scale (and min):
  int8  codes i8 [N, K]; scales f16 [N, K/G]; w = scale * code. G = K is one scale per output
        channel (llmc's int8 recipe); G = 32 is GGUF's Q8_0.
  int4  codes u4x2 [N, K/2]: K codes 0..15 per row packed in blocks of 32 codes, byte b of a
        block holding code b in its low nibble and code b + 16 in its high nibble (GGUF's
        order, so 16 bytes unpack into 32 consecutive inputs); scales and mins f16 [N, K/G];
        w = scale * code + min (asymmetric; G a multiple of 32). GGUF's Q4_1 is exactly this
        with G = 32; Q4_0 (w = d * (code - 8)) is scale d with min -8d.
A dequantized weight is computed in fp32 (an fp16 scale and min widen exactly, and a code times
a scale is exact in fp32).

The int8 KV cache is i8 [L, 2, NB, KVH, BS, D + 4]: each (token, head) row of K or of V holds
its D codes, then its fp32 scale in the row's last KV_SCALE_BYTES = 4 bytes (native byte order):
scale = amax(|row|) / 127, code = rint(x / scale) clamped to [-127, 127] (all 0 for a zero row),
x = code * scale. One scale per token per KV head, so a write touches only its own rows. The C++
kernels state the same width as kv_rows.h's kScaleBytes (tests/test_quant_formats.py compares).

The kernels that compute with these formats, and the ops' meanings (qlinear_ref, ...), are in
kernels/quant.py and beside each kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ir import TensorType

INT4_BLOCK = 32            # codes per packing block (and the smallest int4 group)
KV_SCALE_BYTES = 4         # the fp32 scale at the end of each int8 cache row
INT4_MAX, INT8_MAX = 15, 127
F16_MAX = 65504.0
SCALE_DTYPE = "f16"        # IR element type of scales and mins
KV_CODES_DTYPE = "i8"      # IR element type of an int8 KV cache


@dataclass(frozen=True)
class WeightFormat:
    """One weight format of the module doc: its codes' IR type and how groups may be sized."""

    bits: int
    codes_dtype: str           # IR element type of the codes
    has_mins: bool             # asymmetric: w = scale * code + min
    group_multiple: int        # a group's size is a multiple of this

    @property
    def parts(self) -> tuple[str, ...]:
        """Names of the stored tensors, in the order qlinear and qembedding take them."""
        return ("codes", "scales", "mins") if self.has_mins else ("codes", "scales")

    def part_types(self, n: int, k: int, group_size: int) -> dict[str, TensorType]:
        """IR types of the stored tensors of an [N, K] weight in groups of `group_size`."""
        codes = TensorType(self.codes_dtype, (n, k * self.bits // 8))
        scales = TensorType(SCALE_DTYPE, (n, k // group_size))
        return {"codes": codes, "scales": scales} | ({"mins": scales} if self.has_mins else {})

    def stored_bytes(self, n: int, k: int, group_size: int) -> int:
        """Bytes of an [N, K] weight: codes plus 2-byte scales (and mins)."""
        return n * k * self.bits // 8 + 2 * len(self.parts[1:]) * n * (k // group_size)


WEIGHT_FORMATS = {8: WeightFormat(8, "i8", False, 1), 4: WeightFormat(4, "u4x2", True, INT4_BLOCK)}


def weight_format(bits: int) -> WeightFormat:
    if bits not in WEIGHT_FORMATS:
        raise ValueError(f"no {bits}-bit weight format; llmc has {', '.join(f'int{b}' for b in WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[bits]


# ------------------------------------------------------------------ int4 packing


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 (K a multiple of 32) -> packed uint8 [N, K/2] (see module doc)."""
    n, k = codes.shape
    if k % INT4_BLOCK:
        raise ValueError(f"int4 rows hold a multiple of {INT4_BLOCK} codes, got {k}")
    blocks = codes.to(torch.uint8).view(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)     # [N, K/32, lo|hi, 16]
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2] -> codes uint8 [N, K] in 0..15."""
    n, half = packed.shape
    blocks = packed.view(n, half // (INT4_BLOCK // 2), INT4_BLOCK // 2)             # [N, K/32, 16]
    return torch.stack([blocks & 0xF, blocks >> 4], dim=2).reshape(n, 2 * half)


# ------------------------------------------------------------------ making quantized weights


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input features")
    return w.float().view(n, k // group_size, group_size)                             # [N, K/G, G]


def _to_f16(x: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.isfinite(x).all() or x.abs().max() > F16_MAX:
        raise ValueError(f"a {what} is not finite or exceeds fp16's range; these weights cannot be quantized")
    return x.to(torch.float16)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest: w [N, K] -> (codes i8 [N, K], scales f16 [N, K/G]); G=None is K."""
    groups = _groups(w, group_size or w.shape[1])
    scales = _to_f16(groups.abs().amax(-1) / INT8_MAX, "scale")
    s = scales.float()[..., None]
    codes = torch.where(s > 0, torch.round(groups / torch.where(s > 0, s, 1)), 0).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8).view(w.shape), scales


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest: w [N, K] -> (packed u4x2 [N, K/2], scales f16, mins f16 [N, K/G])."""
    if group_size % INT4_BLOCK:
        raise ValueError(f"int4 group size {group_size} is not a multiple of {INT4_BLOCK}")
    groups = _groups(w, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales, mins = _to_f16((hi - lo) / INT4_MAX, "scale"), _to_f16(lo, "min")
    s, m = scales.float()[..., None], mins.float()[..., None]
    codes = torch.where(s > 0, torch.round((groups - m) / torch.where(s > 0, s, 1)), 0).clamp(0, INT4_MAX)
    return pack_int4(codes.to(torch.uint8).view(w.shape)), scales, mins


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                      bits: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fp32 (or `dtype`) weight [N, K] that quantized `codes` stand for (see module doc)."""
    q = unpack_int4(codes) if bits == 4 else codes
    n, k = q.shape
    group = k // scales.shape[1]
    w = q.to(dtype).view(n, k // group, group) * scales.to(dtype)[..., None]
    if mins is not None:
        w = w + mins.to(dtype)[..., None]
    return w.view(n, k)


# ------------------------------------------------------------------ a quantized weight as a value


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight in a format above: codes, scales and (int4) mins, with its bits and group size.

    Loaders return these for tensors a file already stores in such a format (GGUF Q8_0, Q4_0,
    Q4_1), so quantize_weights can keep their codes and scales bit for bit."""

    bits: int
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    source: str = ""               # the file's name for the format, e.g. "Q4_1"

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * (2 if self.bits == 4 else 1)

    def dequantize(self) -> torch.Tensor:
        return dequantize_weight(self.codes, self.scales, self.mins, self.bits)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The same weight with its rows reordered or selected (a row permutation keeps every group)."""
        pick = lambda t: None if t is None else t[index].contiguous()  # noqa: E731
        return QuantizedWeight(self.bits, self.group_size, pick(self.codes), pick(self.scales), pick(self.mins),
                               self.source)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Weights stacked along N (merged QKV, gate/up), or None when their formats differ."""
    first = parts[0]
    if any((p.bits, p.group_size, p.shape[1], p.mins is None) != (first.bits, first.group_size, first.shape[1],
                                                                    first.mins is None) for p in parts):
        return None
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    sources = "+".join(dict.fromkeys(p.source for p in parts))
    return QuantizedWeight(first.bits, first.group_size, cat([p.codes for p in parts]),
                           cat([p.scales for p in parts]), cat([p.mins for p in parts]), sources)


# ------------------------------------------------------------------ the int8 KV cache


def is_int8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """D of a cache [L, 2, NB, KVH, BS, D] or, for int8, [.., D + 4]."""
    return kv_cache.shape[-1] - (KV_SCALE_BYTES if is_int8_cache(kv_cache) else 0)


def kv_row_width(head_dim: int, int8: bool) -> int:
    """Elements of one cache row of K (or V) for one token and KV head: int8 rows carry their scale."""
    return head_dim + KV_SCALE_BYTES if int8 else head_dim


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., D] (float) -> int8 cache rows [..., D + 4]: codes, then the fp32 scale's bytes."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / INT8_MAX                                 # [..., 1]
    codes = torch.where(scale > 0, torch.round(x / torch.where(scale > 0, scale, 1)), 0).clamp(-INT8_MAX, INT8_MAX)
    return torch.cat([codes.to(torch.int8), scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 cache rows [..., D + 4] -> values [..., D] (code * scale in fp32, then `dtype`)."""
    codes, scale = rows[..., :-KV_SCALE_BYTES], rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)
