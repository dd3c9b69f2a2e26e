"""compiler/quant_format.py's formats: packing round-trips, GGUF's nibble order, rounding within half
a step, and the int8 KV rows, each against plain float64 arithmetic; the formats' stored types and
bytes against what quantizing makes; the C++ kernels' KV row width against the Python one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.quant_format import (KV_SCALE_BYTES, WEIGHT_FORMATS, dequantize_kv_rows, dequantize_weight,
                                        pack_int4, quantize_int4, quantize_int8, quantize_kv_rows, unpack_int4)
from llmc.kernels.native import SOURCE_DIR

KV_ROWS_HEADER = Path(SOURCE_DIR) / "kv_rows.h"


def test_int4_packing_round_trips_in_ggufs_order():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 96), dtype=torch.uint8, generator=g)
    packed = pack_int4(codes)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # byte b of each 32-code block: code b in the low nibble, code b + 16 in the high one
    assert int(packed[2, 16 + 3]) == int(codes[2, 32 + 3]) | (int(codes[2, 32 + 16 + 3]) << 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(codes[:, :40])


@pytest.mark.parametrize("group", [None, 32])
def test_int8_rounds_to_the_nearest_step(group):
    w = torch.randn(7, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    codes, scales = quantize_int8(w, group)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert scales.shape == (7, 1 if group is None else 2) and codes.abs().max() <= 127
    step = scales.double().repeat_interleave(64 // scales.shape[1], dim=1)
    error = (dequantize_weight(codes, scales).double() - w.double()).abs()
    assert (error <= step / 2 + 1e-7).all()                   # half a step (codes against the fp16 scale)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_rounds_to_the_nearest_step_between_min_and_max(group):
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    packed, scales, mins = quantize_int4(w, group)
    deq = dequantize_weight(packed, scales, mins, bits=4).double()
    step = scales.double().repeat_interleave(group, dim=1)
    m = mins.double().repeat_interleave(group, dim=1)
    assert ((deq - w.double()).abs() <= step / 2 + (m - w.double().view(6, -1, group).amin(-1)
                                                    .repeat_interleave(group, 1)).abs() + 1e-6).all()
    codes = unpack_int4(packed).double()
    assert torch.equal(deq, codes * step + m)                 # the meaning: scale * code + min, exact in fp32


def test_a_zero_group_has_zero_codes_and_scale():
    w = torch.zeros(2, 32)
    codes, scales = quantize_int8(w)
    assert not codes.any() and not scales.any()
    packed, scales, mins = quantize_int4(w)
    assert not dequantize_weight(packed, scales, mins, bits=4).any()


def test_kv_rows_hold_codes_then_their_fp32_scale():
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(3)) * 5
    x[1, 0] = 0
    rows = quantize_kv_rows(x)
    assert rows.shape == (3, 2, 68) and rows.dtype == torch.int8
    scale = rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, rtol=0, atol=0)
    back = dequantize_kv_rows(rows).double()
    assert ((back - x.double()).abs() <= scale.double()[..., None] / 2 + 1e-7).all()
    assert not back[1, 0].any()


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 64)])
def test_a_format_states_the_types_and_bytes_quantizing_makes(bits, group):
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    made = quantize_int8(w, group) if bits == 8 else quantize_int4(w, group)
    fmt = WEIGHT_FORMATS[bits]
    types = fmt.part_types(6, 128, group or 128)
    assert list(types) == list(fmt.parts)
    for part, tensor in zip(fmt.parts, made, strict=True):
        assert tensor.dtype == to_torch(types[part].dtype) and tuple(tensor.shape) == types[part].shape
    assert fmt.stored_bytes(6, 128, group or 128) == sum(t.numel() * t.element_size() for t in made)


def test_the_cpp_kernels_kv_row_scale_is_the_python_one():
    """kernels/cpu/kv_rows.h keeps its own kScaleBytes (C++ cannot import it): the two must agree."""
    found = re.findall(r"constexpr\s+int64_t\s+kScaleBytes\s*=\s*(\d+)\s*;", KV_ROWS_HEADER.read_text())
    assert found == [str(KV_SCALE_BYTES)]
