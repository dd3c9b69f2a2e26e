"""ModelRunner: owns the device, the step metadata buffers and one executor.

It builds the executor a `BackendChoice` names (backends.py: the registry picks the backend, its
device and options), sizing the paged KV cache from what the graphs declare, asks it to capture
CUDA graphs of the decode step as its options say, hands each step's host-built metadata to the
executor (which copies it into persistent device buffers, `step_inputs.StepBuffers`, or replays a
graph), and hands logits back on its device for sampling (`run_step`), or on the host for
tools (`run`). It knows no backend's insides: what the executor runs and how is its `capabilities()`.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .artifact import Artifact
from .backends import BackendChoice, choose_backend
from .cuda_graphs import CaptureReport
from .executor import Capabilities, KVCacheSpec, StepOutput
from .slot_program import LaunchTime
from .step_inputs import StepBuffers, StepInputs, build_step_inputs  # noqa: F401  (re-exported)


class ModelRunner:
    """Runs the artifact's prefill and decode graphs against one paged KV cache of `num_blocks` blocks."""

    def __init__(self, artifact: Artifact, num_blocks: int, block_size: int, backend: BackendChoice,
                 max_num_seqs: int = 64, max_verify_width: int = 1):
        self.artifact = artifact
        self.backend, self.device = backend.name, backend.device
        cache_type = artifact.graphs["prefill"].node_map()["kv_cache"].type
        self.executor = backend.build(artifact, KVCacheSpec.from_graph_type(cache_type, num_blocks, block_size))
        self.buffers = StepBuffers(self.device)
        self.graph_report: CaptureReport | None = self.executor.capture_decode(max_num_seqs, max_verify_width)

    @classmethod
    def for_backend(cls, artifact: Artifact, num_blocks: int, block_size: int, backend: str = "torch",
                    options: Mapping[str, object] | None = None, device: str = "auto",
                    max_num_seqs: int = 64) -> "ModelRunner":
        """A runner on the backend `choose_backend` picks for `backend`, `device` and `options`."""
        return cls(artifact, num_blocks, block_size, choose_backend(backend, artifact, device, options), max_num_seqs)

    @property
    def capabilities(self) -> Capabilities:
        """Which kernels run, whether decode replays CUDA graphs, which graphs run as step plans."""
        return self.executor.capabilities()

    @property
    def cuda_graphs(self) -> bool:
        """Whether pure-decode steps replay captured CUDA graphs."""
        return self.capabilities.cuda_graphs

    @property
    def graph_error(self) -> str | None:
        """Why capturing CUDA graphs failed, where it did."""
        return self.executor.graph_error

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.executor.kv_cache

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write block copies (all layers, K and V) before a step writes."""
        if copies:
            src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in zip(*copies))
            self.executor.copy_blocks(src, dst)

    def run(self, entry: str, step: StepInputs) -> torch.Tensor:
        """Logits [R, vocab] (fp32, on the host): each chunk's rows at its `logit_positions`, in chunk
        order (for tools that read whole logits; the engine samples from `run_step`'s)."""
        return self.run_step(entry, step).logits.cpu()

    def run_step(self, entry: str, step: StepInputs) -> StepOutput:
        """`run`'s logits left on the runner's device, computed (the device has finished them, so the
        caller's clock covers the forward pass), with the greedy picks where the step made them beside
        the logits (StepOutput.greedy: a CPU step plan's; the sampler's argmax otherwise). The logits
        may be the executor's output buffer: read them before the next step runs."""
        out = self.executor.step(entry, step, self.buffers)
        if out.raw_logits.device.type == "cuda":
            torch.cuda.current_stream(out.raw_logits.device).synchronize()
        return out

    def run_timed(self, entry: str, step: StepInputs) -> tuple[torch.Tensor, list[LaunchTime]]:
        """`run` launched eagerly, and each launch's wall time (for profiles; slower than `run`)."""
        logits, timings = self.executor.run_timed(entry, self.executor.on_device(step, self.buffers))
        return logits.cpu(), timings


def allocate_kv_cache(cache_type, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed CPU cache of the layout the graphs declare, [L, 2, NB, KVH, BS, D] (for tools)."""
    return KVCacheSpec.from_graph_type(cache_type, num_blocks, block_size).allocate(torch.device("cpu"))
