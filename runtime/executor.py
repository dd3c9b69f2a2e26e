"""The executor seam (DESIGN decision 4): one interface, one backend per file, chosen from a registry.

An executor is built from an artifact (graphs + weights), a device, a KV cache spec and its
backend's options; it owns the paged KV cache on that device (plus one scratch block the block
manager never hands out, for padding rows) and the weights in the layout its kernels want
(decided once, here, never at run time); `run(entry, step)` runs one step's graph and returns the
logits of the positions its `logits_indices` names, [R, vocab] fp32 on the device (R logit rows;
decode: one a sequence). `step(entry, host_step, buffers)` is what the runner calls: a pure-decode
step, or a verify step of a captured width (every sequence verifying the same number of drafts, on
the prefill graph), replays a captured CUDA graph when `capture_decode` made them (cuda_graphs.py);
any other step runs eagerly on its metadata on the device (a GPU: loaded into the runner's buffers;
the CPU: the host's tensors).

A backend tells the engine what it needs and what it does: `kv_bytes_per_block` (the engine sizes
the cache with it), `capabilities()` (which kernels run, whether decode replays CUDA graphs, which
graphs run as one step plan and why the others do not), and where it runs (`place`, `auto_picks`,
read by the registry in backends.py). Its options are a frozen dataclass (`options_type`) that
validates itself. The runner and the engine know no backend's insides.

  torch    torch_executor.py   every op through torch (aten), native CPU kernels where they fit; with
                               those, a graph they all take runs as one step plan (step_plan.py)
  triton   triton_executor.py  the artifact's generated Triton kernels (a GPU, or the
                               interpreter on CPU tensors with TRITON_INTERPRET=1)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import TensorType
from llmc.kernels.argmax import argmax_rows

from .artifact import Artifact
from .cuda_graphs import CaptureReport, DecodeGraphs, decode_batch_sizes, graph_entry, verify_graph_sizes
from .huge_pages import huge_page_zeros
from .sampling_params import RequestError
from .slot_program import LaunchTime, SlotProgram
from .step_inputs import StepBuffers, StepInputs

if TYPE_CHECKING:
    from .step_plan import StepPlanProgram

DEVICES = ("auto", "cpu", "cuda")

log = logging.getLogger("llmc")


@dataclass(frozen=True)
class StepOutput:
    """A computed step: its logit rows as the program made them (`raw_logits`: a bf16 step plan's are
    bf16) and, where the program picked greedy tokens as its LM head made the logits (a CPU step plan:
    DESIGN 14, sampling where the logits are), each row's pick (int64 [R], argmax_rows' meaning); None
    where it did not. `logits` [R, vocab] (fp32, on the device) is made when first read: a step of
    greedy rows the program picked never reads it (widening a bf16 row of a large vocabulary is a
    fresh allocation and a pass over it, once the step has evicted the caches)."""

    raw_logits: torch.Tensor
    greedy: torch.Tensor | None = None

    @cached_property
    def logits(self) -> torch.Tensor:
        return self.raw_logits.float()

    def greedy_tokens(self) -> torch.Tensor:
        """Each logit row's greedy token (int64 [R]): the step's own picks where it made them, else
        argmax_rows over the logits."""
        return self.greedy if self.greedy is not None else argmax_rows(self.logits)


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache the graphs declare, sized: [L, 2, NB, KVH, BS, D] of `dtype`. D is a cache
    row: head_dim elements, or for an int8 cache head_dim codes then their fp32 scale (KV_SCALE_BYTES),
    as the quantize_kv pass typed it."""

    layers: int
    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_graph_type(cls, cache_type: TensorType, num_blocks: int, block_size: int) -> "KVCacheSpec":
        layers, _, _, kv_heads, _, head_dim = cache_type.shape
        return cls(layers, num_blocks, kv_heads, block_size, head_dim, to_torch(cache_type.dtype))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of every layer and KV head, block_size rows of D elements."""
        return self.layers * 2 * self.kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def allocate(self, device: torch.device, extra_blocks: int = 0) -> torch.Tensor:
        """The zeroed cache; on a CPU on huge pages where the kernel grants them (huge_pages.py: a long
        context's decode streams its K/V rows as it streams the weights)."""
        shape = (self.layers, 2, self.num_blocks + extra_blocks, self.kv_heads, self.block_size, self.head_dim)
        if device.type == "cpu":
            return huge_page_zeros(shape, self.dtype, "the KV cache")
        return torch.zeros(shape, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class ExecutorOptions:
    """The options every executor has: the capture of its decode step (the base class's `capture_decode`).

    cuda_graphs: None captures on a GPU where the backend allows it (vLLM's default), True asks for
    it (and says once why it cannot where it cannot), False never does. A backend's own options
    subclass this, each field validated in its __post_init__ (RequestError: one sentence)."""

    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise RequestError(f"backend option cuda_graphs={self.cuda_graphs!r} must be true, false or unset")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class GraphRun:
    """How one entry graph runs: as one step plan, or op by op and why (the node and the reason)."""

    entry: str
    plan: bool
    why: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What an executor runs and how, as the engine and the tools read it."""

    kernels: str                    # what computes the ops: 'native' or 'reference' (torch), 'triton'
    graph_safe: bool                # its decode step can be captured as CUDA graphs
    cuda_graphs: bool               # decode (and verify) steps replay captured CUDA graphs now
    graphs: tuple[GraphRun, ...]    # each entry graph: a step plan, or op by op and why

    def plans(self) -> list[str]:
        """The entry graphs that run as one step plan."""
        return [g.entry for g in self.graphs if g.plan]

    def describe_plans(self) -> str:
        """'step plans: prefill yes, decode yes', or 'step plans: prefill yes, decode op by op (%12
        (gelu) has no plan kernel)'; one reason shared by every graph is said once."""
        off = [g for g in self.graphs if not g.plan]
        if off and len(off) == len(self.graphs) and len({g.why for g in off}) == 1:
            return f"step plans: none; {', '.join(g.entry for g in off)} op by op ({off[0].why})"
        return "step plans: " + ", ".join(f"{g.entry} yes" if g.plan else f"{g.entry} op by op ({g.why})"
                                          for g in self.graphs)


class Executor:
    """The base of every backend: a backend's __init__ builds `programs`, one per entry graph, and
    says how each runs (`graph_runs`) and with which kernels (`kernels`); its class says where it
    runs (`place`, `auto_picks`), its options (`options_type`) and its cache's bytes per block."""

    backend: ClassVar[str] = ""                  # its name in the registry and on the command line
    options_type: ClassVar[type[ExecutorOptions]] = ExecutorOptions
    graph_safe: ClassVar[bool] = True            # its launches never wait for the host: a CUDA graph can hold them
    auto_rank: ClassVar[int] = 0                 # `--backend auto` asks backends from the highest rank down

    @classmethod
    def place(cls, artifact: Artifact, device: str) -> torch.device:
        """The device this backend runs `artifact` on when asked for `device` ('auto', 'cpu' or 'cuda',
        a GPU being there if asked for); RequestError, one sentence with the fix, where it cannot."""
        raise NotImplementedError

    @classmethod
    def auto_picks(cls, artifact: Artifact, device: str) -> bool:
        """Whether `--backend auto` takes this backend (when no higher-ranked one did)."""
        return False

    @classmethod
    def kv_bytes_per_block(cls, kv: KVCacheSpec) -> int:
        """Bytes one block of the cache takes on the device: the engine sizes the cache with it."""
        return kv.block_bytes

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec,
                 options: ExecutorOptions | None = None):
        self.artifact = artifact
        self.device = device
        self.options = self.options_type() if options is None else options
        assert isinstance(self.options, self.options_type), f"{self.backend} takes {self.options_type.__name__}"
        self.kv_cache = kv.allocate(device, extra_blocks=1)
        self.scratch_block = kv.num_blocks             # the extra block: padding rows write only there
        self.block_size = kv.block_size
        self.programs: dict[str, SlotProgram | StepPlanProgram] = {}   # entry -> its graph's program (set by the backend)
        self.graph_runs: dict[str, GraphRun] = {}      # entry -> how its program runs (set by the backend)
        self.kernels = self.backend                    # what computes the ops (a backend may say more)
        self.graphs: DecodeGraphs | None = None
        self.graph_error: str | None = None

    def capabilities(self) -> Capabilities:
        return Capabilities(self.kernels, self.graph_safe, self.graphs is not None, tuple(self.graph_runs.values()))

    def capture_decode(self, max_num_seqs: int, max_verify_width: int = 1) -> CaptureReport | None:
        """Capture the decode step for up to `max_num_seqs` sequences, and the verify step for widths
        2..`max_verify_width` (1 + the most drafts a step verifies; 1: none), as `options.cuda_graphs`
        asks, where the device and the backend allow; a capture that fails leaves every step eager,
        says why once (a warning) and keeps it in `graph_error`."""
        wanted = self.options.cuda_graphs
        if wanted is False:
            return None
        if self.device.type != "cuda" or not self.graph_safe:
            if wanted:
                why = "without a CUDA GPU there is nothing to capture" if self.device.type != "cuda" else \
                    f"the {self.backend} backend's ops wait for the host, which a CUDA graph cannot hold"
                log.info("--cuda-graphs does nothing here: %s; every step runs eagerly", why)
            return None
        context = self.artifact.config.max_position_embeddings
        max_blocks = min(self.scratch_block, -(-context // self.block_size))
        try:
            report = self.capture_decode_graphs(max_num_seqs, max_blocks, max_verify_width=max_verify_width)
        except RuntimeError as exc:     # a kernel that cannot be captured: serve eagerly, and say why
            self.graphs, self.graph_error = None, f"{type(exc).__name__}: {exc}"
            log.warning("capturing CUDA graphs of the decode step failed (%s); every step runs eagerly",
                        self.graph_error)
            return None
        log.info("%s", report.describe())
        return report

    def capture_decode_graphs(self, max_num_seqs: int, max_blocks: int, stand_in: bool = False,
                              max_verify_width: int = 1) -> CaptureReport:
        """Capture the decode step for every batch size up to `max_num_seqs`, and the verify step for
        widths 2..`max_verify_width` that fit a block (cuda_graphs.verify_graph_sizes), block tables
        `max_blocks` wide (the most blocks one sequence can hold). `stand_in`: replay by rerunning
        eagerly (tests on a CPU); otherwise the device must be a GPU and the backend graph-safe."""
        assert stand_in or (self.device.type == "cuda" and self.graph_safe), "CUDA graphs need a GPU backend"
        verify = verify_graph_sizes(max_num_seqs, max_verify_width, self.block_size)
        graphs = DecodeGraphs(lambda step, tokens: self.run(graph_entry(tokens), step), self.device,
                              decode_batch_sizes(max_num_seqs), max_blocks, self.scratch_block, self.block_size,
                              cuda=not stand_in, verify=verify)
        report = graphs.capture()
        self.graphs = graphs
        return report

    def step(self, entry: str, host: StepInputs, buffers: StepBuffers) -> StepOutput:
        """`run_step` of a host-built step: a captured decode or verify graph where one fits, else eagerly
        with the metadata on the device (`on_device`). One inference mode either way (each entry costs
        ~5-30 us of a decode step once the forward has evicted the caches)."""
        key = self.graphs.key_for(host, entry) if self.graphs is not None else None
        if key is None and self.device.type == "cpu":   # on_device writes nothing here: run's mode is enough
            return self.run_step(entry, self.on_device(host, buffers))
        with torch.inference_mode():                    # replays and device buffers write inference tensors
            if key is not None:
                return StepOutput(self.graphs.replay(host, key))
            return self.run_step(entry, self.on_device(host, buffers))

    def on_device(self, host: StepInputs, buffers: StepBuffers) -> StepInputs:
        """The step's metadata where the kernels read it: `buffers` on a GPU; on the CPU the host's
        tensors already are (packing them into the buffers would only cost a copy)."""
        return host if self.device.type == "cpu" else buffers.load(host)

    def run(self, entry: str, step: StepInputs) -> torch.Tensor:
        """Logits [R, vocab] (fp32, on the device): a row per position the step asks for (prefill), or per
        sequence (decode)."""
        return self.run_step(entry, step).logits

    @torch.inference_mode()
    def run_step(self, entry: str, step: StepInputs) -> StepOutput:
        """`run`'s logits, and the greedy picks where the program made them beside the logits."""
        logits, *picks = self.programs[entry](step.feeds(self.kv_cache))
        return StepOutput(logits, picks[0] if picks else None)

    @torch.inference_mode()
    def run_timed(self, entry: str, step: StepInputs) -> tuple[torch.Tensor, list[LaunchTime]]:
        """`run`, and the wall time of each launch (the device synchronised after each)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        (logits, *_), timings = self.programs[entry].timed(step.feeds(self.kv_cache), sync)   # *_: greedy picks
        return logits.float(), timings

    @torch.inference_mode()
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: blocks `src` to `dst` (all layers, K and V), before a step writes them."""
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
