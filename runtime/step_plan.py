"""The torch backend's step plans: a graph lowered to one native step plan (kernels/cpu/step_plan.cpp),
each op a native kernel call and a whole step one call from Python, run by one team of threads
with a barrier between calls (on a CPU, what replaying a CUDA graph is on a GPU).

Contract: `lower_step_plan(graph, weights, block_size, kernels=...)` takes an entry graph, the
weights as kernels/native_ops.py's `prepare_weights` left them and the artifact's generated CPU
kernels (runtime/cpu_program.py); it walks the graph's CPU units (compiler/codegen/cpu_units.py)
and returns a `StepPlanProgram` when every unit has a plan kernel that takes it, else raises
`NotPlannable` with the first reason. Plan kernels: a generated unit's C++ function (every
elementwise and row-wise op: the norms, silu_mul, add, split, ...), and the templates embedding (a
table of rows, or a tied float table kept as panels), qembedding (int8 / int4 codes as the artifact
stores them, or a tied table kept as quantized panels or quads), linear (float panels) and qlinear
(int8 / int4 panels or quads), each with an optional bias (these four: plan_gemm.py), rope_kv_write
(a packed qkv), paged_attention and paged_decode_attention, index_select (of rows), and the
collectives all_reduce / all_gather of a tensor-parallel graph
(tensor_parallel/plan_collectives.py), over activations [rows, W] of one float dtype (f32 or bf16),
rows the step's tokens (the rows of the graph's first input) or, after the one gather of rows, its
indices' count (the IR's R, logit rows: one a sequence, or more where a step asks for logits at
several positions), and a paged KV cache of that dtype or int8 in blocks of 16. Each call runs the
same kernel as the op-by-op native table does, on the same split of the work but for a prompt's GEMM
on AMX tiles (split by tokens, so each thread's rows stay in its core's caches; each output is the
same dot product), so a plan's outputs equal that table's bit for bit; the torch refs are the meaning
(tests compare both).

The program is called like a SlotProgram (feeds by input name -> the graph's outputs), and where the
GEMM that writes the graph's one output (the logits) is a plan kernel, it picks each row's greedy token
as it makes them (the instruction's `picks`, an int64 output after the graph's: `picks` is True);
`timed` gives each instruction's time as measured inside the parallel region.

Instructions: kernels/step_plan_isa.py describes them; a lowering names every arg of its
instruction (`encode("linear", out=..., x=..., ...)`), and the C++ side reads them by the same
names. A generated kernel (an elementwise or row-wise fusion unit compiled to C++) runs as
instruction `generated` through `lower_generated`; its ABI, a C function in a shared library:

    extern "C" void NAME(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last);

ptrs[i] is the first row of the unit's i-th value (its inputs in unit order, then its outputs),
row r of value i at `(T*)ptrs[i] + r * strides[i]` (strides in elements: an activation's width, a
2-D constant's row stride, 0 for a 1-D constant such as a norm weight, 1 for a 1-D graph input);
it computes rows [first, last) of every output (the team splits its first output's rows), its
widths, dtypes and attributes baked in; it never fails or allocates, and runs concurrently on
disjoint row ranges. A float linear whose result only the generated unit after it reads, at
columns 0, W, 2W, ... (W that unit's output width, whole panels of 32), where the unit is
column-local (codegen gave it a window form, NAME_cols), runs with it as one instruction,
`linear_epilogue` (plan_generated.py's `epilogue_reads` decides): on AMX tiles the unit runs on each 32 columns as the
GEMM makes them (kernels/cpu/amx_epilogue.h), on the AVX-512 panel kernel (fp32, and bf16 off AMX) on
each 32 columns of a few rows as their panels meet them (panel_epilogue.h), otherwise (a decode step
of up to 4 rows, AMX split by panels) the GEMM, a barrier and the unit; the same values every way. A
quantized one likewise, `qlinear_epilogue`: with f32 prompts from 16 rows each window's panels are
dequantized once and met a few rows at a time (kernels/cpu/f32_dequant_gemm.h), otherwise the GEMM, a
barrier and the unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from llmc.compiler.codegen.cpu_units import cpu_units, unit_kind
from llmc.compiler.codegen.units import KernelUnit
from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import Graph, Node, Value
from llmc.compiler.ops import OPS, operands_of
from llmc.compiler.ops.attention import attention_options
from llmc.kernels.gemv import GemvWeight
from llmc.kernels.native import native_module
from llmc.kernels.rope import RopeTables
from llmc.kernels.step_plan_isa import Encoded, encode

from .cpu_program import CpuKernels
from .liveness import dying_after
from .slot_program import LaunchTime, weight_names
from .plan_gemm import GEMM_LOWERINGS, NotPlannable
from .plan_generated import epilogue_reads, lower_epilogue, lower_generated
from .tensor_parallel.plan_collectives import COLLECTIVE_LOWERINGS

PLAN_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PlanLaunch:
    """One instruction of a plan, for profiles: the node it runs, that op's kind and the weights it takes."""

    label: str
    kind: str
    weights: tuple[str, ...] = ()


class StepPlanProgram:
    """`graph` as one native step plan; call with the step's input tensors by name."""

    def __init__(self, graph: Graph, plan: Any, input_names: list[str], rope: list[RopeTables],
                 positions: str, gathered: str, launches: list[PlanLaunch], constants: list[Any],
                 keepalive: tuple = (), picks: bool = False):
        self.graph = graph
        self.picks = picks                      # after the graph's outputs, each logit row's greedy pick
        self.input_names = input_names
        self._gathered = gathered               # the input whose rows per-sequence values have
        self.profile_name = f"llmc::step_plan.{graph.name}"
        self._plan = plan
        self._rope = rope                       # one (cos, sin) input pair per rotation, after the graph's inputs
        self._positions = positions             # the input they rotate by
        self._launches = launches
        self.constants = constants              # what the plan holds (weights as prepared), for memory reports
        self.keepalive = keepalive              # the libraries of its generated kernels, kept mapped
        self._run = native_module().run_plan    # plan_binding.cpp: the plan's run without TorchScript's boxing
        self._address = plan.address()          # valid while self._plan lives

    def _inputs(self, feeds: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], int, int]:
        """The plan's inputs (the graph's, then each rotation's cos and sin tables up to the step's
        largest position), the step's tokens and the rows its gather makes (as many as its indices:
        logits may be asked at several positions). The plan reads each token's rows of the tables itself:
        gathering them here cost ~50 us of a decode step with the caches cold."""
        inputs = [feeds[name] for name in self.input_names]
        if self._rope:
            positions = feeds[self._positions]
            end = int(positions.max()) + 1 if positions.numel() else 0
            for tables in self._rope:
                inputs.extend(tables.covering(end))
        return inputs, inputs[0].shape[0], feeds[self._gathered].shape[0]

    def __call__(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if not torch.autograd._profiler_enabled():                  # a record_function costs ~5-20 us a step
            return self._run(self._address, *self._inputs(feeds))
        with torch.profiler.record_function(self.profile_name):     # what torch.profiler shows of the step
            return self._run(self._address, *self._inputs(feeds))

    def timed(self, feeds: dict[str, torch.Tensor], sync: Callable[[], None] = lambda: None):
        """The outputs, and each instruction's LaunchTime (its seconds measured by the team's first thread,
        its waits by each thread; a CPU has nothing to `sync`, taken as SlotProgram.timed takes it)."""
        outputs, seconds, waits = self._plan.run_timed(*self._inputs(feeds))
        team = len(waits) // max(1, len(seconds))
        return outputs, [LaunchTime(launch.label, launch.kind, s, waits=tuple(waits[i * team:(i + 1) * team]),
                                    weights=launch.weights)
                         for i, (launch, s) in enumerate(zip(self._launches, seconds))]


class _Lowering:
    """The state of one lowering: plan value ids of the graph's values, registers of temporaries."""

    def __init__(self, graph: Graph, weights: dict[str, Any], block_size: int):
        self.graph, self.weights, self.nodes = graph, weights, graph.node_map()
        self.block_size = block_size
        self.rows_dim = graph.inputs()[0].type.shape[0]                # the step's tokens
        gathers = {n.type.shape[0] for n in graph.nodes if n.op == "index_select"}
        self.gathered_dim = gathers.pop() if len(gathers) == 1 else self.rows_dim   # its logit rows (R)
        caches = [to_torch(n.type.dtype) for n in graph.inputs() if n.name == "kv_cache"]
        self.dtype = self._float_dtype(int8_cache=caches == [torch.int8])
        self.plan = torch.classes.llmc.StepPlan(self.dtype == torch.bfloat16, caches == [torch.int8])
        self.ids: dict[Value, int] = {}
        self.constants: list[Any] = []
        self.rope: dict[tuple, tuple[RopeTables, int, int]] = {}   # each rotation's tables, plan ids of cos, sin
        self.positions = ""
        self.picks = -1                                                # the logits GEMM's index output
        self.gathered = graph.inputs()[0].name                          # index_select's indices, if any
        self.keepalive: list[Any] = []                                 # generated kernels' libraries
        launched = [n for n in graph.nodes if n.op not in ("input", "weight")]
        dying = dying_after([(n.inputs, [n.value(k) for k in range(len(n.types))]) for n in launched], graph.outputs)
        self.dying = {n.name: dead for n, dead in zip(launched, dying)}  # liveness.py
        self.free_registers: list[int] = []
        self.registers = 0
        self.register_of: dict[Value, int] = {}

    def _float_dtype(self, int8_cache: bool) -> torch.dtype:
        """The one dtype every op computes in (an int8 cache, which rope_kv_write returns, aside)."""
        floats = {to_torch(t.dtype) for n in self.graph.nodes if n.op not in ("input", "weight") for t in n.types}
        floats -= {torch.int8} if int8_cache else set()
        if len(floats) != 1 or next(iter(floats)) not in PLAN_DTYPES:
            raise NotPlannable(f"graph {self.graph.name} computes in {sorted(map(str, floats))}, not one of f32/bf16")
        return next(iter(floats))

    # -- values --------------------------------------------------------------------------------

    def add_inputs(self) -> list[str]:
        for i, node in enumerate(self.graph.inputs()):
            like = torch.empty(0, dtype=to_torch(node.type.dtype))
            self.ids[node.value()] = self.plan.input(i, like)
        return [n.name for n in self.graph.inputs()]

    def graph_input(self, v: Value, node: Node) -> int:
        """The plan value of a graph input `node` reads (token ids, slots, block tables, lengths)."""
        if self.nodes[v.node].op != "input":
            raise NotPlannable(f"{node.name} ({node.op}) reads {v}, computed in the graph, where the plan takes "
                               "a graph input")
        return self.ids[v]

    def weight(self, v: Value) -> Any:
        node = self.nodes[v.node]
        return self.weights[v.node[2:]] if node.op == "weight" else None

    def constant(self, t: torch.Tensor) -> int:
        self.constants.append(t)
        return self.plan.constant(t)

    def panels(self, w: GemvWeight) -> tuple[int, int, int]:
        """Plan values of a prepared weight's panels, scales and mins (-1 where it has none)."""
        self.constants.append(w)
        return tuple(-1 if t is None else self.plan.constant(t) for t in (w.weight, w.scales, w.mins))

    def width(self, v: Value, node: Node) -> int:
        t = self.graph.type_of(v)
        if len(t.shape) != 2 or t.shape[0] not in (self.rows_dim, self.gathered_dim) \
                or not isinstance(t.shape[1], int) or to_torch(t.dtype) != self.dtype:
            raise NotPlannable(f"{node.name} ({node.op}) reads or writes {v} of type {t}, not "
                               f"[{self.rows_dim} or {self.gathered_dim}, W] {self.dtype}")
        return t.shape[1]

    def gathered_rows(self, v: Value) -> bool:                        # the logit rows, not the tokens
        return self.graph.type_of(v).shape[0] == self.gathered_dim != self.rows_dim

    def activation(self, v: Value, node: Node) -> int:
        if v not in self.ids:
            raise NotPlannable(f"{node.name} ({node.op}) reads {v}, which the plan does not hold")
        self.width(v, node)
        return self.ids[v]

    def result(self, node: Node, index: int = 0) -> int:
        """A plan value for result `index` of `node`: an output tensor, or a register of the arena."""
        v = node.value(index)
        width = self.width(v, node)
        if self.gathered_rows(v) and self.gathered == self.graph.inputs()[0].name:
            raise NotPlannable(f"{node.name} ({node.op}) makes logit rows without a gather of rows")
        if v in self.graph.outputs:
            self.ids[v] = self.plan.output(width, self.gathered_rows(v))
        else:
            reg = self.free_registers.pop() if self.free_registers else self._new_register()
            self.register_of[v] = reg
            self.ids[v] = self.plan.temporary(reg, width, self.gathered_rows(v))
        return self.ids[v]

    def picks_for(self, node: Node) -> int:
        """An index output for the greedy picks of `node`'s result where that is the graph's one output
        (the logits, which the GEMM then picks in as it makes them); -1 for any other GEMM."""
        if self.graph.outputs != (node.value(),) or self.picks >= 0:
            return -1
        self.picks = self.plan.index_output(self.gathered_rows(node.value()))
        return self.picks

    def _new_register(self) -> int:
        self.registers += 1
        return self.registers - 1

    def release(self, node: Node) -> None:
        """Registers whose value's last reader is `node` (or that nobody reads) become free."""
        for v in self.dying[node.name]:
            if v in self.register_of:
                self.free_registers.append(self.register_of.pop(v))


def _cache(lo: _Lowering, node: Node, v: Value, head_dim: int, multiple: int) -> int:
    if v not in lo.ids or lo.block_size != 16 or head_dim % multiple:
        raise NotPlannable(f"{node.name} ({node.op}) needs the graph's KV cache in blocks of 16 and head_dim a "
                           f"multiple of {multiple}")
    return lo.ids[v]


def _lower_rope_kv_write(lo: _Lowering, node: Node) -> Encoded:
    a = node.attrs
    heads, kv_heads, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    named = operands_of(node)
    if "qkv" not in named:
        raise NotPlannable(f"{node.name} (rope_kv_write) takes q, k and v apart; the plan takes a packed qkv")
    qkv, positions, cache, slots = named.qkv, named.positions, named.kv_cache, named.slot_mapping
    width = lo.width(qkv, node)
    if width != (heads + 2 * kv_heads) * d:
        raise NotPlannable(f"{node.name} (rope_kv_write) reads a packed qkv of {width}, not "
                           f"{(heads + 2 * kv_heads) * d}")
    source = lo.activation(qkv, node)
    if lo.nodes[positions.node].op != "input" or lo.positions not in ("", positions.node):
        raise NotPlannable(f"{node.name} (rope_kv_write) rotates by positions that are not the graph's one input")
    lo.positions = positions.node
    key = RopeTables.key(a)
    if key not in lo.rope:
        first = len(lo.graph.inputs()) + 2 * len(lo.rope)
        like = torch.empty(0, dtype=torch.float32)
        lo.rope[key] = (RopeTables.for_attrs(a), lo.plan.input(first, like), lo.plan.input(first + 1, like))
    _, cos, sin = lo.rope[key]
    cache_id = _cache(lo, node, cache, d, 32)
    rotary = a.get("rotary_dim", d)                       # even (the op's type rule)
    lo.ids[node.value(1)] = cache_id                       # the cache written in place
    return encode("rope_kv_write", q_out=lo.result(node), q=source, k=source, v=source, q_col=0, k_col=heads * d,
                  v_col=(heads + kv_heads) * d, row_width=width, cos=cos, sin=sin,
                  positions=lo.graph_input(positions, node), cache=cache_id,
                  slots=lo.graph_input(slots, node), layer=a["layer"], heads=heads, kv_heads=kv_heads, head_dim=d,
                  rotary_dim=rotary, **_qk_norms(lo, node, named))


NORM_SPANS = {"": 0, "head": 1, "all": 2}          # rope_kv_write's qk_norm -> the instruction's norm_span


def _qk_norms(lo: _Lowering, node: Node, named) -> dict:
    """The rope_kv_write instruction's norm args: its q/k norm weights as plan constants."""
    a, span = node.attrs, NORM_SPANS[node.attrs.get("qk_norm", "")]
    if not span:
        return {"q_norm": -1, "k_norm": -1, "norm_span": 0, "norm_product": 0, "norm_eps": 0.0}
    ids = {}
    for name in ("q_norm", "k_norm"):
        w = lo.weight(named[name])
        if not isinstance(w, torch.Tensor) or w.dtype != lo.dtype:
            raise NotPlannable(f"{node.name} (rope_kv_write) has a {name} that is not a {lo.dtype} weight")
        ids[name] = lo.constant(w.contiguous())
    return {**ids, "norm_span": span, "norm_eps": a["norm_eps"],
            "norm_product": int(a.get("norm_rounding") == "product")}


def _lower_attention(lo: _Lowering, node: Node) -> Encoded:
    """paged_decode_attention (q, cache, tables, lens) or paged_attention (and query_start_loc)."""
    x, a = operands_of(node), node.attrs
    q, cache, tables, lens = x.q, x.kv_cache, x.block_tables, x.seq_lens
    out, q_id, cache_id = lo.result(node), lo.activation(q, node), _cache(lo, node, cache, a["head_dim"], 16)
    tables_id, lens_id = lo.graph_input(tables, node), lo.graph_input(lens, node)
    chunks = {"query_start_loc": lo.graph_input(x.query_start_loc, node)} if "query_start_loc" in x else {}
    return encode(node.op, out=out, q=q_id, cache=cache_id, block_tables=tables_id, seq_lens=lens_id, **chunks,
                  layer=a["layer"], heads=a["num_heads"], kv_heads=a["num_kv_heads"], head_dim=a["head_dim"],
                  scale=a["scale"], **attention_options(a))


def _lower_index_select(lo: _Lowering, node: Node) -> Encoded:
    named = operands_of(node)
    x, indices = named.x, named.indices
    if lo.gathered_rows(x) or not lo.gathered_rows(node.value()):
        raise NotPlannable(f"{node.name} (index_select) gathers rows other than the logit rows from the tokens")
    width = lo.width(x, node)
    if lo.gathered not in (lo.graph.inputs()[0].name, indices.node):
        raise NotPlannable(f"{node.name} (index_select) gathers by a second set of indices; the plan takes one")
    lo.gathered = indices.node
    return encode("index_select", out=lo.result(node), x=lo.activation(x, node), indices=lo.graph_input(indices, node),
                  width=width)


# the template ops' lowerings (elementwise and row-wise ops run as generated units, lower_generated)
LOWERINGS = {**GEMM_LOWERINGS, "rope_kv_write": _lower_rope_kv_write,
             "paged_decode_attention": _lower_attention, "paged_attention": _lower_attention,
             "index_select": _lower_index_select, **COLLECTIVE_LOWERINGS}


Lowering = Callable[[_Lowering, Node], Encoded]


def _plan_units(graph: Graph, lowerings: dict[str, Lowering],
                kernels: CpuKernels | None) -> list[tuple[KernelUnit, int | None]]:
    """The graph's CPU units in launch order with their generated functions' addresses (None: the
    unit's nodes lower one by one through `lowerings`, which must have each of them)."""
    units = kernels.units(graph) if kernels is not None else [(u, None) for u in cpu_units(graph)]
    for unit, address in units:
        for node in unit.nodes if address is None else ():
            if node.op not in lowerings:
                raise NotPlannable(f"{node.name} ({node.op}) has no plan kernel")
    return units


def _weights(nodes) -> tuple[str, ...]:
    """The weights `nodes` take, by name (LaunchTime.weights)."""
    return weight_names(v for node in nodes for v in node.inputs)


def lower_step_plan(graph: Graph, weights: dict[str, Any], block_size: int,
                    lowerings: dict[str, Lowering] = LOWERINGS, kernels: CpuKernels | None = None) -> StepPlanProgram:
    """`graph` as a step plan over `weights` (as prepare_weights left them) for a cache of
    `block_size`-token blocks, walking its CPU units (compiler/codegen/cpu_units.py): a generated
    unit calls its function in `kernels` (the artifact's generated C++), a template node its entry in
    `lowerings` (without `kernels`, a generated unit's nodes need entries too); NotPlannable names
    the first node it cannot take."""
    units = _plan_units(graph, lowerings, kernels)
    windows = kernels.windows(graph) if kernels is not None else [None] * len(units)
    lo = _Lowering(graph, weights, block_size)
    names = lo.add_inputs()
    launches = []
    fused = set()                                # units run as the epilogue of the GEMM before them
    for i, (unit, address) in enumerate(units):
        if i in fused:
            continue
        reads = epilogue_reads(lo, unit, units[i + 1][0], windows[i + 1]) if i + 1 < len(units) else 0
        gemm_op = unit.nodes[0].op
        if reads and lowerings.get(gemm_op) is LOWERINGS[gemm_op]:     # the GEMM and its epilogue: one call
            fused.add(i + 1)
            epilogue, fn = units[i + 1]
            label = "+".join(n.op for n in (*unit.nodes, *epilogue.nodes))
            steps = [(lower_epilogue(lo, unit.nodes[0], epilogue, fn, windows[i + 1], reads, kernels.library),
                      (*unit.nodes, *epilogue.nodes), PlanLaunch(label, "gemm", _weights(unit.nodes)))]
        elif address is not None:                # one generated kernel: the unit's values die after it
            launch = PlanLaunch("+".join(n.op for n in unit.nodes), unit_kind(unit), _weights(unit.nodes))
            steps = [(lower_generated(lo, address, list(unit.inputs), list(unit.outputs), kernels.library),
                      unit.nodes, launch)]
        else:
            steps = ((lowerings[node.op](lo, node), (node,), PlanLaunch(node.op, OPS[node.op].kind, _weights([node])))
                     for node in unit.nodes)
        for instruction, nodes, launch in steps:
            lo.plan.add(instruction.opcode, instruction.args, instruction.f)
            for node in nodes:
                lo.release(node)
            launches.append(launch)
    rope = [tables for tables, _, _ in lo.rope.values()]
    return StepPlanProgram(graph, lo.plan, names, rope, lo.positions, lo.gathered, launches, lo.constants,
                           tuple(lo.keepalive), picks=lo.picks >= 0)
