"""The executor seam (DESIGN decision 4): one interface, one backend per file.

An executor is built from an artifact (graphs + weights), a device and a KV cache spec; it owns
the paged KV cache on that device (plus one scratch block the block manager never hands out, for
padding rows) and the weights in the layout its kernels want (decided once, here, never at run
time); `run(entry, step)` runs one step's graph and returns the logits of the sampled positions,
[S, vocab] fp32 on the device. `step(entry, host_step, buffers)` is what the runner calls: a
pure-decode step replays a captured CUDA graph when `capture_decode_graphs` made them
(cuda_graphs.py), any other step runs eagerly on its metadata on the device (a GPU: loaded into
the runner's buffers; the CPU: the host's tensors).
The runner owns the step's metadata and knows no backend's insides.

  torch    torch_executor.py   every op through torch (aten), native CPU kernels where they fit; with
                               those, a graph they all take runs as one step plan (step_plan.py)
  triton   triton_executor.py  the artifact's generated Triton kernels (a GPU, or the
                               interpreter on CPU tensors with TRITON_INTERPRET=1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import TensorType

from .artifact import Artifact
from .cuda_graphs import CaptureReport, DecodeGraphs, decode_batch_sizes
from .sampling_params import RequestError
from .slot_program import LaunchTime, SlotProgram
from .step_inputs import StepBuffers, StepInputs

if TYPE_CHECKING:
    from .step_plan import StepPlanProgram

BACKENDS = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache the graphs declare, sized: [L, 2, NB, KVH, BS, D] of `dtype`."""

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

    def allocate(self, device: torch.device, extra_blocks: int = 0) -> torch.Tensor:
        blocks = self.num_blocks + extra_blocks
        return torch.zeros(self.layers, 2, blocks, self.kv_heads, self.block_size, self.head_dim,
                           dtype=self.dtype, device=device)


class Executor:
    """The base of both backends: a backend's __init__ builds `programs`, one per entry graph."""

    backend: str = ""
    graph_safe: bool = True     # a step's launches never wait for the host, so a CUDA graph can hold them

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec):
        self.artifact = artifact
        self.device = device
        self.kv_cache = kv.allocate(device, extra_blocks=1)
        self.scratch_block = kv.num_blocks             # the extra block: padding rows write only there
        self.block_size = kv.block_size
        self.programs: dict[str, SlotProgram | StepPlanProgram] = {}   # entry -> its graph's program (set by the backend)
        self.graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_blocks: int, stand_in: bool = False) -> CaptureReport:
        """Capture the decode step for every batch size up to `max_num_seqs`, block tables `max_blocks`
        wide (the most blocks one sequence can hold). `stand_in`: replay by rerunning eagerly (tests
        on a CPU); otherwise the device must be a GPU and the backend graph-safe."""
        assert stand_in or (self.device.type == "cuda" and self.graph_safe), "CUDA graphs need a GPU backend"
        graphs = DecodeGraphs(lambda step: self.run("decode", step), self.device, decode_batch_sizes(max_num_seqs),
                              max_blocks, self.scratch_block, self.block_size, cuda=not stand_in)
        report = graphs.capture()
        self.graphs = graphs
        return report

    @torch.inference_mode()
    def step(self, entry: str, host: StepInputs, buffers: StepBuffers) -> torch.Tensor:
        """`run` of a host-built step: a captured decode graph where one fits, else eagerly with the
        metadata on the device (`on_device`)."""
        batch = self.graphs.batch_size_for(host) if entry == "decode" and self.graphs is not None else None
        if batch is not None:
            return self.graphs.replay(host, batch)
        return self.run(entry, self.on_device(host, buffers))

    def on_device(self, host: StepInputs, buffers: StepBuffers) -> StepInputs:
        """The step's metadata where the kernels read it: `buffers` on a GPU; on the CPU the host's
        tensors already are (packing them into the buffers would only cost a copy)."""
        return host if self.device.type == "cpu" else buffers.load(host)

    @torch.inference_mode()
    def run(self, entry: str, step: StepInputs) -> torch.Tensor:
        """Logits [S, vocab] (fp32, on the device) of the last computed token of each sequence."""
        (logits,) = self.programs[entry](step.feeds(self.kv_cache))
        return logits.float()

    @torch.inference_mode()
    def run_timed(self, entry: str, step: StepInputs) -> tuple[torch.Tensor, list[LaunchTime]]:
        """`run`, and the wall time of each launch (the device synchronised after each)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        (logits,), timings = self.programs[entry].timed(step.feeds(self.kv_cache), sync)
        return logits.float(), timings

    @torch.inference_mode()
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: blocks `src` to `dst` (all layers, K and V), before a step writes them."""
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]


def resolve_backend(backend: str, artifact: Artifact, device: str = "auto") -> tuple[str, torch.device]:
    """The backend and device a request for `backend` on `device` means here; RequestError if it cannot run.

    auto: triton on a GPU when the artifact has kernels, torch on the CPU elsewhere. triton
    needs the artifact's kernels and a GPU, or TRITON_INTERPRET=1 to run them on the CPU. torch
    runs on the CPU unless `device` is cuda (the GPU reference of the triton backend).
    """
    if backend not in BACKENDS:
        raise RequestError(f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise RequestError(f"device {device!r} is unknown; choose one of {', '.join(DEVICES)}")
    has_kernels = "triton" in artifact.manifest.get("backends", [])
    gpu = torch.cuda.is_available()
    if device == "cuda" and not gpu:
        raise RequestError("device cuda was asked for but torch sees no CUDA GPU here; use --device cpu")
    if backend == "auto":
        backend = "triton" if gpu and has_kernels and device != "cpu" else "torch"
    if backend == "torch":
        return "torch", torch.device("cuda" if device == "cuda" else "cpu")
    if not has_kernels:
        raise RequestError(f"{artifact.path} has no Triton kernels; compile it with `llmc compile --target cuda` "
                           "or use --backend torch")
    if gpu and device != "cpu":
        return "triton", torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "triton", torch.device("cpu")
    raise RequestError("--backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run its kernels slowly in "
                       "Triton's interpreter on the CPU); use --backend torch here")
