"""Kernel modules for units that a hand-written Triton template computes.

  gemm group        [rmsnorm | add_rmsnorm ->] linear (+ bias) -> [silu | gelu_tanh | silu_mul |
                    gelu_tanh_mul over the gate/up halves] -> [+ residual] -> [softcap]:
                    kernels/triton/gemm.py, the epilogue as the template's constexpr flags, the
                    norm as its prologue (merged by units.py's triton_units: norm_linear_triton);
                    qlinear (int8/int4 weight) with the same epilogues: kernels/triton/qgemm.py
  attention + O     paged_decode_attention -> linear (+ the gemm group's epilogues), merged by
                    triton_units: stage 1 (paged_decode_attention_parts), then the GEMM whose
                    prologue is the merge (merge_linear_triton): 2 launches, not 3
  rope_kv_write     kernels/triton/rope_kv_write.py (inv_freq made once per executor, on its device)
  qkv group         [rmsnorm | add_rmsnorm ->] linear -> rope_kv_write (merged by triton_units):
                    kernels/triton/qkv_rope.py, RoPE and the K/V write as the QKV GEMM's epilogue
  paged_attention / paged_decode_attention   kernels/triton/paged_{prefill,decode}_attention.py
  embedding / index_select                   kernels/triton/gather.py
  qembedding                                 kernels/triton/qembedding.py
The rope_kv_write and attention launchers read an int8 KV cache (i8 rows of codes + fp32
scale) or a float one; which is the cache tensor's dtype, so their modules are the same.

Each module defines `build(device)`, which returns `launch(*inputs) -> outputs`: the unit's
input values in, its output values out, in the unit's order. Attributes (layer, scale, eps,
head counts) are written into the module as constants.
"""

from __future__ import annotations

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Node, TensorType, Value
from llmc.compiler.ops import Operands, operands_of
from llmc.compiler.ops.attention import ATTN_OPTIONS
from llmc.compiler.ops.rope import rope_attention_factor

from .errors import CodegenError
from .gemm_configs import pick_config, pick_qconfig
from .units import MERGE_ATTENTION, PROLOGUE_NORMS, KernelUnit


def _module(unit: KernelUnit, imports: list[str], prelude: list[str], call: str, results: list[str],
            constants: list[str] = ()) -> str:
    params = ", ".join(f"in{i}" for i in range(len(unit.inputs)))
    returns = ", ".join(results) + ("," if len(results) == 1 else "")
    return "\n".join([
        *imports, "", "", *constants, *([""] * 2 * bool(constants)),
        "def build(device):",
        '    """The launcher on `device`: the unit\'s inputs in, its outputs out."""',
        *[f"    {line}" for line in prelude],
        "",
        f"    def launch({params}):",
        f"        result = {call}",
        f"        return {returns}",
        "",
        "    return launch",
    ])


def _arg(unit: KernelUnit, v: Value) -> str:
    return f"in{unit.inputs.index(v)}"


def _pick(unit: KernelUnit, node: Node) -> list[str]:
    """Expressions for the unit's outputs from `result`, the node's return value."""
    if len(node.types) == 1:
        return ["result"]
    return [f"result[{v.index}]" for v in unit.outputs]


def _gemm_configs(gemm: Node, n_out: int, k: int, gated: bool) -> list[str]:
    """Launch configs chosen now, at compile time, per bucket of M (the step's token count)."""

    def pick(m: int):
        if gemm.op == "qlinear":
            a = gemm.attrs
            return pick_qconfig(m, n_out, k, bits=a["bits"], group_size=a["group_size"], gated=gated,
                                dtype=gemm.type.dtype)
        return pick_config(m, n_out, k, gated=gated, dtype=gemm.type.dtype)

    buckets = [(16, 16), (32, 32), (64, 64), (None, 128)]
    rows = [f"    ({limit}, {pick(m)!r})," for limit, m in buckets]
    return ["configs = [  # (most tokens, config), chosen at compile time", *rows, "]",
            "", "", "def config_for(tokens):", "    return next(c for limit, c in configs if limit is None or tokens <= limit)"]


def _named(unit: KernelUnit, node: Node) -> Operands:
    """The node's operands by name, as launch() arguments."""
    return Operands({k: _arg(unit, v) for k, v in operands_of(node).items()})


def _gemm_operands(unit: KernelUnit, gemm: Node, prologue: Node | None) -> tuple[str, str, str]:
    """(x, weight arguments, bias) of a linear or qlinear node as launch() expressions: a float
    weight `w`, or the quantized weight's `codes, scales, mins`; x is the prologue norm's x where
    the unit has one (the normed row is the kernel's own), decode attention's stage 1 (its parts)
    where the unit starts with one."""
    x = Operands({k: _arg(unit, v) for k, v in operands_of(gemm).items() if not (prologue and k == "x")})
    weight = x.weight if gemm.op == "linear" else f"{x.codes}, {x.scales}, {x.get('mins', 'None')}"
    if prologue is not None and prologue.op == MERGE_ATTENTION:
        return _attention_call(unit, prologue, "paged_decode_attention_parts"), weight, x.get("bias", "None")
    return (_named(unit, prologue).x if prologue else x.x), weight, x.get("bias", "None")


def _gemm_call(gemm: Node, operands: tuple[str, str, str], residual: str, activation: str, gated: bool,
               softcap: float, norm: Operands | None, eps: float, merge: Operands | None = None) -> str:
    """The launcher call; `merge`: decode attention's operands where x is its stage 1 (q: its rows)."""
    x, weight, bias = operands
    capped = f", softcap={softcap!r}" if softcap else ""
    options = f"activation={activation!r}, gated={gated}{capped}, config=config_for({merge.q if merge else x}.shape[0])"
    if gemm.op == "qlinear":
        a = gemm.attrs
        return (f"qlinear_triton({x}, {weight}, {bias}, {residual}, bits={a['bits']}, "
                f"group_size={a['group_size']}, {options})")
    if merge is not None:
        return f"merge_linear_triton({x}, {weight}, {bias}, {residual}, {options})"
    if norm is not None:
        return (f"norm_linear_triton({x}, {norm.weight}, {weight}, {bias}, {residual}, eps={eps!r}, "
                f"norm_residual={norm.get('residual', 'None')}, {options})")
    return f"linear_triton({x}, {weight}, {bias}, {residual}, {options})"


# epilogue op -> the GEMM template's activation: applied to the output, or (gated) to the gate half
_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_tanh"}
_GATED = {"silu_mul": "none", "gelu_tanh_mul": "gelu_tanh"}          # "none": the gate's SiLU implied


def _gemm(unit: KernelUnit, types: dict[Value, TensorType]) -> str:
    prologue = unit.nodes[0] if unit.nodes[0].op in (*PROLOGUE_NORMS, MERGE_ATTENTION) else None
    gemm, *epilogue = unit.nodes[1:] if prologue else unit.nodes
    activation, gated, residual, last, split, softcap = "none", False, "None", gemm.value(), None, 0.0
    for node in epilogue:
        if split is not None or softcap:
            raise CodegenError(f"{unit.label}: codegen cannot lower {node.op!r} after a split or softcap of a GEMM's "
                               "output")
        if node.op == "split" and node.inputs[0] == last:
            split = node                     # the GEMM's columns, handed out as views: no extra pass
            continue
        first_activation = node.inputs[0] == last and not gated and activation == "none" and residual == "None"
        if node.op in _GATED and len(node.inputs) == 1 and first_activation:
            gated, activation = True, _GATED[node.op]
        elif node.op in _ACTIVATIONS and first_activation:
            activation = _ACTIVATIONS[node.op]
        elif node.op == "softcap" and node.inputs[0] == last:
            softcap = node.attrs["cap"]                         # the last op of the group (checked above)
        elif node.op == "add" and last in node.inputs and residual == "None":
            residual = _arg(unit, node.inputs[1] if node.inputs[0] == last else node.inputs[0])
        else:
            raise CodegenError(f"{unit.label}: codegen cannot lower {node.op!r} as an epilogue of the GEMM template "
                               "(it takes bias, then an activation or a gated one, then a residual add, then a "
                               "softcap)")
        last = node.value()
    results = _gemm_results(unit, prologue, last, split)
    n_out, k = types[gemm.value()].shape[1], types[gemm.inputs[0]].shape[1]
    norm = _named(unit, prologue) if prologue and prologue.op in PROLOGUE_NORMS else None
    merge = _named(unit, prologue) if prologue and prologue.op == MERGE_ATTENTION else None
    call = _gemm_call(gemm, _gemm_operands(unit, gemm, prologue), residual, activation, gated, softcap, norm,
                      prologue.attrs["eps"] if norm else 0.0, merge)
    imports = [_gemm_import(gemm, prologue)]
    return _module(unit, imports, [], call, results, _gemm_configs(gemm, n_out // 2 if gated else n_out, k, gated))


def _gemm_import(gemm: Node, prologue: Node | None) -> str:
    if gemm.op == "qlinear":
        return "from llmc.kernels.triton.qgemm import GemmConfig, qlinear_triton"
    if prologue is not None and prologue.op == MERGE_ATTENTION:
        return ("from llmc.kernels.triton.gemm import GemmConfig, merge_linear_triton\n"
                "from llmc.kernels.triton.paged_decode_attention import paged_decode_attention_parts")
    return f"from llmc.kernels.triton.gemm import GemmConfig, {'norm_' if prologue else ''}linear_triton"


def _gemm_results(unit: KernelUnit, prologue: Node | None, last: Value, split: Node | None) -> list[str]:
    """Expressions for the unit's outputs: the GEMM's result (`result`, or `result[0]` beside the
    norm prologue's sum `result[1]`), or the split's column views of it."""
    y = "result[0]" if prologue is not None and prologue.op in PROLOGUE_NORMS else "result"
    total = prologue.value(1) if prologue and prologue.op == "add_rmsnorm" else None
    if split is not None:
        return _split_views(unit, split, y, total)
    if last not in unit.outputs or any(v not in (last, total) for v in unit.outputs):
        raise CodegenError(f"{unit.label}: a GEMM group may only be read through its last op")
    return [y if v == last else "result[1]" for v in unit.outputs]


def _split_views(unit: KernelUnit, split: Node, y: str, total: Value | None) -> list[str]:
    """Column views of the GEMM result `y` for the split's parts that the unit hands out (and the
    prologue's sum `total`, result[1])."""
    bounds, start = [], 0
    for size in split.attrs["sizes"]:
        bounds.append((start, start + size))
        start += size
    if any(v.node != split.name and v != total for v in unit.outputs):
        raise CodegenError(f"{unit.label}: a GEMM group ending in a split may only be read through the split")
    return ["result[1]" if v == total else f"{y}[:, {bounds[v.index][0]}:{bounds[v.index][1]}]"
            for v in unit.outputs]


def _rope_kv_write(unit: KernelUnit, node: Node) -> str:
    a = node.attrs
    args = ", ".join(_named(unit, node).values())    # (qkv | q, k, v), positions, kv_cache, slot_mapping[, norms]
    rotary = a.get("rotary_dim", a["head_dim"])           # the values of a head that turn (partial rotary)
    prelude = [f"inv_freq = rope_inv_freq({rotary}, {a['theta']!r}, {a['scaling']!r}).to(device)"]
    norms = f", qk_norm={a['qk_norm']!r}, norm_eps={a['norm_eps']!r}" if a.get("qk_norm") else ""
    norms += f", rotary_dim={rotary}" if "rotary_dim" in a else ""
    norms += f", norm_rounding={a['norm_rounding']!r}" if "norm_rounding" in a else ""
    call = (f"rope_kv_write_triton({args}, layer={a['layer']}, num_heads={a['num_heads']}, "
            f"num_kv_heads={a['num_kv_heads']}, head_dim={a['head_dim']}, inv_freq=inv_freq, "
            f"attention_factor={rope_attention_factor(a['scaling'])!r}{norms})")
    imports = ["from llmc.kernels.rope import rope_inv_freq",
               "from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton"]
    return _module(unit, imports, prelude, call, _pick(unit, node))


def _qkv_rope(unit: KernelUnit, types: dict[Value, TensorType]) -> str:
    """The QKV GEMM (with its norm prologue or none) with RoPE + KV write as its epilogue."""
    *front, gemm, rope = unit.nodes
    prologue = front[0] if front else None
    x, w, bias = _gemm_operands(unit, gemm, prologue)
    r = Operands({k: _arg(unit, v) for k, v in operands_of(rope).items() if k != "qkv"})   # qkv: the GEMM's
    a = rope.attrs
    norm = ""
    if prologue is not None:
        n = _named(unit, prologue)
        norm = f", norm_weight={n.weight}, eps={prologue.attrs['eps']!r}, norm_residual={n.get('residual', 'None')}"
    call = (f"qkv_rope_triton({x}, {w}, {bias}, {r.positions}, {r.kv_cache}, {r.slot_mapping}, layer={a['layer']}, "
            f"num_heads={a['num_heads']}, num_kv_heads={a['num_kv_heads']}, head_dim={a['head_dim']}, "
            f"inv_freq=inv_freq, attention_factor={rope_attention_factor(a['scaling'])!r}{norm}, "
            f"config=config_for({x}.shape[0]))")
    index = {rope.value(0): "result[0]", rope.value(1): "result[1]"}
    if prologue is not None and prologue.op == "add_rmsnorm":
        index[prologue.value(1)] = "result[2]"
    if any(v not in index for v in unit.outputs):
        raise CodegenError(f"{unit.label}: a QKV GEMM with RoPE may only be read through the rope and the norm's sum")
    imports = ["from llmc.kernels.rope import rope_inv_freq",
               "from llmc.kernels.triton.qkv_rope import GemmConfig, qkv_rope_triton"]
    prelude = [f"inv_freq = rope_inv_freq({a['head_dim']}, {a['theta']!r}, {a['scaling']!r}).to(device)"]
    pairs, k = types[gemm.value()].shape[1] // 2, types[gemm.inputs[0]].shape[1]
    return _module(unit, imports, prelude, call, [index[v] for v in unit.outputs],
                   _gemm_configs(gemm, pairs, k, gated=True))


def _attention_call(unit: KernelUnit, node: Node, function: str) -> str:
    a, args = node.attrs, ", ".join(_named(unit, node).values())   # q, kv_cache, block_tables, seq_lens[, qsl]
    options = "".join(f", {k}={a[k]!r}" for k in ATTN_OPTIONS if k in a)        # window, softcap: where set
    return f"{function}({args}, {a['layer']}, {a['scale']!r}{options})"


def _attention(unit: KernelUnit, node: Node) -> str:
    kind = "decode" if node.op == "paged_decode_attention" else "prefill"
    function = f"paged_{kind}_attention_triton"
    call = _attention_call(unit, node, function)
    return _module(unit, [f"from llmc.kernels.triton.paged_{kind}_attention import {function}"], [], call, ["result"])


def _qembedding(unit: KernelUnit, node: Node) -> str:
    a, x = node.attrs, _named(unit, node)
    call = (f"qembedding_triton({x.codes}, {x.scales}, {x.get('mins', 'None')}, {x.ids}, bits={a['bits']}, group_size={a['group_size']}, "
            f"dtype={to_torch(a['dtype'])})")
    return _module(unit, ["import torch", "", "from llmc.kernels.triton.qembedding import qembedding_triton"], [],
                   call, ["result"])


def _gather(unit: KernelUnit, node: Node) -> str:
    x = _named(unit, node)
    table, rows = (x.table, x.ids) if node.op == "embedding" else (x.x, x.indices)
    call = f"gather_rows_triton({table}, {rows})"
    return _module(unit, ["from llmc.kernels.triton.gather import gather_rows_triton"], [], call, ["result"])


# op -> the template of a unit that is that one node; a GEMM's unit is the GEMM and its epilogue
TEMPLATES = {"rope_kv_write": _rope_kv_write, "paged_attention": _attention, "paged_decode_attention": _attention,
             "embedding": _gather, "index_select": _gather, "qembedding": _qembedding}
TEMPLATE_OPS = ("linear", "qlinear", *TEMPLATES)
# kernel launches of a unit that starts with the op where it is more than one: decode attention's
# split and merge stages (kernels/triton/paged_decode_attention.py; one launch where a single split
# covers the context, a choice from the step's shapes, so the count here is the most a step launches),
# or, merged with the O projection (triton_units), its split stage and the GEMM that merges as its prologue
TEMPLATE_LAUNCHES = {"paged_decode_attention": 2}


def unit_launches(unit: KernelUnit) -> int:
    """How many kernels the unit's module launches in one step."""
    return TEMPLATE_LAUNCHES.get(unit.nodes[0].op, 1)


def template_module_source(unit: KernelUnit, types: dict[Value, TensorType]) -> str:
    """The kernel module of a template unit (see module docstring); CodegenError if none fits."""
    first = unit.nodes[0]
    if len(unit.nodes) > 1 and unit.nodes[-1].op == "rope_kv_write":
        return _qkv_rope(unit, types)
    if first.op in ("linear", "qlinear") or first.op in (*PROLOGUE_NORMS, MERGE_ATTENTION) and len(unit.nodes) > 1:
        return _gemm(unit, types)
    if len(unit.nodes) != 1:
        raise CodegenError(f"{unit.label}: codegen has no template for a group starting with {first.op!r}")
    if first.op in TEMPLATES:
        return TEMPLATES[first.op](unit, first)
    raise CodegenError(f"{unit.label}: codegen cannot lower op {first.op!r}; compile for --target cpu, or keep the "
                       "passes that turn it into ops with kernels")
