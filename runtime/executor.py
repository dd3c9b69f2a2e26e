"""The executor seam (DESIGN decision 4): one interface, one backend per file.

An executor is built from an artifact (graphs + weights), a device and a KV cache spec; it owns
the paged KV cache on that device and the weights in the layout its kernels want (decided once,
here, never at run time); `run(entry, step)` runs one step's graph and returns the logits of
the sampled positions, [S, vocab] fp32 on the device. The runner owns the device and the step's
metadata and knows no backend's insides.

  torch    torch_executor.py   every op through torch (aten), native CPU kernels where they fit
  triton   triton_executor.py  the artifact's generated Triton kernels (a GPU, or the
                               interpreter on CPU tensors with TRITON_INTERPRET=1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import TensorType

from .artifact import Artifact
from .sampling_params import RequestError
from .slot_program import LaunchTime, SlotProgram
from .step_inputs import StepInputs

BACKENDS = ("auto", "torch", "triton")


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

    def allocate(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.layers, 2, self.num_blocks, self.kv_heads, self.block_size, self.head_dim,
                           dtype=self.dtype, device=device)


class Executor:
    """The base of both backends: a backend's __init__ builds `programs`, one per entry graph."""

    backend: str = ""

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec):
        self.artifact = artifact
        self.device = device
        self.kv_cache = kv.allocate(device)
        self.programs: dict[str, SlotProgram] = {}     # entry -> its graph's launches (set by the backend)

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


def resolve_backend(backend: str, artifact: Artifact) -> tuple[str, torch.device]:
    """The backend and device a request for `backend` means here; RequestError if it cannot run.

    auto: triton on a GPU when the artifact has kernels, torch on the CPU elsewhere. triton
    needs the artifact's kernels and a GPU, or TRITON_INTERPRET=1 to run them on the CPU.
    """
    if backend not in BACKENDS:
        raise RequestError(f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    has_kernels = "triton" in artifact.manifest.get("backends", [])
    gpu = torch.cuda.is_available()
    if backend == "auto":
        return ("triton", torch.device("cuda")) if gpu and has_kernels else ("torch", torch.device("cpu"))
    if backend == "torch":
        return "torch", torch.device("cpu")
    if not has_kernels:
        raise RequestError(f"{artifact.path} has no Triton kernels; compile it with `llmc compile --target cuda` "
                           "or use --backend torch")
    if gpu:
        return "triton", torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "triton", torch.device("cpu")
    raise RequestError("--backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run its kernels slowly in "
                       "Triton's interpreter on the CPU); use --backend torch here")
