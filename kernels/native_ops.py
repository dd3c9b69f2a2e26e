"""The torch backend's op table with llmc's native CPU kernels (kernels/cpu/*.cpp) in place of
the torch refs for the ops that dominate a step: paged attention, RoPE + KV write, RMSNorm and
SiLU-and-multiply; GEMMs run on weights packed once into oneDNN's layout (kernels/linear.py).
Every entry checks, per call, that its kernel takes the inputs (dtype, block size, head_dim)
and runs the op's torch ref where it does not, so any artifact runs.
"""

from __future__ import annotations

import json
import logging

from .activation import native_silu_mul_fits, silu_mul_cpu
from .attention import native_attention_fits, paged_attention_cpu, paged_decode_attention_cpu
from .linear import PackedLinear, packable
from .native import NativeBuildError, load_native_kernels
from .rmsnorm import add_rmsnorm_cpu, native_norm_fits, rmsnorm_cpu
from .rope import RopeTables
from .rope_kv_write import native_rope_kv_write_fits, rope_kv_write_cpu
from .torch_ops import OP_IMPLS, OpImpl


def native_op_impls() -> dict[str, OpImpl]:
    """A fresh op table (its RoPE tables are its own); load_native_kernels() must have run."""
    rope_tables: dict[str, RopeTables] = {}
    packed: dict[int, PackedLinear] = {}         # by id() of a weight; the entry holds the weight

    def linear(x, a):
        weight = x[1]
        entry = packed.get(id(weight))
        if entry is None or entry.weight is not weight:
            if not packable(weight):
                return OP_IMPLS["linear"](x, a)
            entry = packed[id(weight)] = PackedLinear(weight)
        if x[0].dtype != weight.dtype:
            return OP_IMPLS["linear"](x, a)
        return entry(*x[:1], *x[2:])

    def tables_for(a: dict) -> RopeTables:
        key = json.dumps([a["head_dim"], a["theta"], a["scaling"]], sort_keys=True)
        if key not in rope_tables:
            rope_tables[key] = RopeTables(a["head_dim"], a["theta"], a["scaling"])
        return rope_tables[key]

    def rope_kv_write(x, a):
        cache = x[-2]
        if not native_rope_kv_write_fits(cache, x[0].dtype):
            return OP_IMPLS["rope_kv_write"](x, a)
        return rope_kv_write_cpu(*x, layer=a["layer"], num_heads=a["num_heads"], num_kv_heads=a["num_kv_heads"],
                                 head_dim=a["head_dim"], tables=tables_for(a))

    def paged_attention(x, a):
        if not native_attention_fits(x[0], x[1]):
            return OP_IMPLS["paged_attention"](x, a)
        return paged_attention_cpu(*x, a["layer"], a["scale"])

    def paged_decode_attention(x, a):
        if not native_attention_fits(x[0], x[1]):
            return OP_IMPLS["paged_decode_attention"](x, a)
        return paged_decode_attention_cpu(*x, a["layer"], a["scale"])

    def add_rmsnorm(x, a):
        fits = native_norm_fits(x[0]) and x[0].dtype == x[1].dtype == x[2].dtype
        return add_rmsnorm_cpu(*x, a["eps"]) if fits else OP_IMPLS["add_rmsnorm"](x, a)

    def rmsnorm(x, a):
        fits = native_norm_fits(x[0]) and x[0].dtype == x[1].dtype
        return rmsnorm_cpu(*x, a["eps"]) if fits else OP_IMPLS["rmsnorm"](x, a)

    def silu_mul(x, a):
        return silu_mul_cpu(*x) if native_silu_mul_fits(*x) else OP_IMPLS["silu_mul"](x, a)

    return {**OP_IMPLS, "linear": linear, "rope_kv_write": rope_kv_write, "paged_attention": paged_attention,
            "paged_decode_attention": paged_decode_attention, "add_rmsnorm": add_rmsnorm, "rmsnorm": rmsnorm,
            "silu_mul": silu_mul}


KERNEL_CHOICES = ("auto", "native", "reference")


def choose_op_impls(kernels: str) -> tuple[dict[str, OpImpl], str]:
    """The op table for a kernel choice, and what it resolved to ('native' or 'reference').

    'reference' runs the torch refs; 'native' builds the C++ kernels or fails with
    NativeBuildError; 'auto' builds them and, where that fails, logs one warning and runs the refs.
    """
    if kernels == "reference":
        return dict(OP_IMPLS), "reference"
    try:
        load_native_kernels()
    except NativeBuildError as err:
        if kernels == "native":
            raise
        logging.getLogger("llmc").warning("%s; running the torch reference kernels instead", err)
        return dict(OP_IMPLS), "reference"
    return native_op_impls(), "native"
