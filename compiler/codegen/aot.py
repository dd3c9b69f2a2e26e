"""An artifact's generated kernel modules launched through prefill and decode steps on `meta`
tensors: how kernels/triton/aot_compile.py compiles an artifact's kernels for a GPU without one.

The units run as the triton executor runs them (runtime/triton_executor.py): the modules of the
artifact's kernels/ folder, checked to be the text this codegen writes for its IR, built once;
then each unit's `launch` in the lowering's order, reading what the graph's inputs, its weights
and earlier units gave it (a split GEMM's column views included). On the `meta` device a tensor
has a shape, a dtype and strides but no memory, so each Triton launch sees the arguments a GPU
step of that size gives it, and nothing is computed. Symbolic dims are bound by `step_sizes`;
each entry runs at one token count in each of the GEMM configs' M buckets (templates.py).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.compiler.artifact_format import ENTRY_FILES, KERNELS_DIR, ArtifactError, read_manifest
from llmc.compiler.dtypes import USER_DTYPES, to_torch
from llmc.compiler.ir import Graph, IRError, TensorType, Value, parse_graph

from . import Lowering, import_kernel_module, lower
from .errors import CodegenError

STEP_ROWS = (1, 24, 64, 200)                  # token rows of a step: one per M bucket of the GEMM configs
STEP_ROWS_OF = {"prefill": STEP_ROWS, "decode": STEP_ROWS}
QUICK_ROWS = {"prefill": (37,), "decode": (1,)}
END_ROWS = {"prefill": (200,), "decode": (1,)}  # the GEMMs' prefill and decode tiles, one step each
CACHE_BLOCKS, BLOCK_SIZE, TABLE_WIDTH = 64, 16, 8   # NB, BS (the engine's default), MB: 128 keys a sequence
SHORT_DTYPES = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}
_DIM = re.compile(r"([A-Za-z_]\w*)([+-]\d+)?")      # a symbol, optionally plus or minus a constant: S+1


@dataclass(frozen=True)
class Case:
    """One launcher call (or one step of an artifact): every kernel it launches gets compiled
    (kernels/triton/aot_compile.py runs them)."""
    label: str
    dtype: str                      # the float dtype it computes in, for the summary
    launch: Callable[[], object]


def step_sizes(entry: str, rows: int) -> dict[str, int]:
    """Sizes of the symbolic dims of an `entry` step with `rows` token rows: prefill T tokens of up
    to 3 sequences with logits at every token (R = T logit rows, so the GEMM after the gather runs
    in every M bucket as well), decode S sequences of one token each (R = S)."""
    return {"T": rows, "S": rows if entry == "decode" else min(rows, 3), "R": rows, "NB": CACHE_BLOCKS,
            "BS": BLOCK_SIZE, "MB": TABLE_WIDTH}


def _size(dim: int | str, sizes: dict[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    m = _DIM.fullmatch(dim)
    if m is None or m.group(1) not in sizes:
        raise CodegenError(f"dim {dim!r} has no size in a step (sizes are known for {', '.join(sizes)})")
    return sizes[m.group(1)] + int(m.group(2) or 0)


def meta_tensor(t: TensorType, sizes: dict[str, int]) -> torch.Tensor:
    """A contiguous tensor of type `t` on the meta device, its symbolic dims bound by `sizes`."""
    return torch.empty([_size(d, sizes) for d in t.shape], dtype=to_torch(t.dtype), device="meta")


def load_launchers(lowering: Lowering, folder: Path, written: bool) -> dict[str, Callable]:
    """Each kernel module's launcher, built for `meta`: the files of `folder` (an artifact's kernels/,
    checked to be the lowering's text), or the lowering's text written there first if `written`."""
    launchers = {}
    for name, source in lowering.modules.items():
        file = folder / f"{name}.py"
        if written:
            file.write_text(source)
        elif not file.is_file() or file.read_text() != source:
            raise ArtifactError(f"{file} is missing or differs from what this llmc generates for the artifact's "
                                "IR; recompile it with `llmc compile --target cuda`")
        launchers[name] = import_kernel_module(file, name).build(torch.device("meta"))
    return launchers


def run_step(entry: str, graph: Graph, lowering: Lowering, launchers: dict[str, Callable],
             sizes: dict[str, int]) -> None:
    """Every unit of the `entry` graph launched once, in order, on meta tensors of a step of `sizes`."""
    env: dict[Value, torch.Tensor] = {node.value(): meta_tensor(node.type, sizes) for node in graph.nodes
                                      if node.op in ("input", "weight")}
    for unit, module in zip(lowering.units[entry], lowering.plan[entry], strict=True):
        results = launchers[module](*(env[v] for v in unit.inputs))
        env.update(zip(unit.outputs, results, strict=True))


def graph_cases(graphs: dict[str, Graph], label: str, dtype: str, rows: dict[str, tuple[int, ...]],
                kernels: Path | None = None) -> Iterator[Case]:
    """aot_compile's cases for `graphs` (computing in `dtype`: fp32, fp16 or bf16) lowered by this
    codegen: each graph's step at each of its token counts `rows[entry]`, through the modules in
    `kernels` (an artifact's folder), or, if None, modules written to a temporary folder."""
    lowering = lower(graphs)
    with tempfile.TemporaryDirectory(prefix="llmc-aot-") as scratch:
        launchers = load_launchers(lowering, kernels or Path(scratch), written=kernels is None)
        for entry, graph in graphs.items():
            for n in rows[entry]:
                sizes = step_sizes(entry, n)
                yield Case(f"{label} {entry} {'S' if entry == 'decode' else 'T'}={n}", dtype,
                           lambda entry=entry, graph=graph, sizes=sizes: run_step(entry, graph, lowering, launchers,
                                                                                  sizes))


def artifact_cases(path: str | Path, rows: dict[str, tuple[int, ...]] = STEP_ROWS_OF) -> Iterator[Case]:
    """aot_compile's cases for the artifact at `path` (compiled with --target cuda): its prefill
    and decode steps at `rows[entry]` tokens each (STEP_ROWS_OF, QUICK_ROWS or END_ROWS). An
    artifact that cannot be read is one failing case."""
    path = Path(path)
    try:
        config = read_manifest(path)["compile"]
        quant, dtype = config.get("quant", {}), SHORT_DTYPES[USER_DTYPES.get(config.get("dtype"), "f32")]
        graphs = {entry: parse_graph((path / file).read_text()) for entry, file in ENTRY_FILES.items()}
        label = f"{path.name} (weights {quant.get('weights', 'none')}, kv {quant.get('kv_dtype', 'auto')})"
        yield from graph_cases(graphs, label, dtype, rows, path / KERNELS_DIR)
    except (ArtifactError, CodegenError, IRError, OSError) as exc:
        yield Case(f"{path} (load)", "?", lambda exc=exc: _raise(exc))


def _raise(exc: Exception) -> None:
    raise exc
