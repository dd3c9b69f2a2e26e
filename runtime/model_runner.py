"""ModelRunner: owns the device, the step metadata buffers and one executor.

It picks the backend (`executor.resolve_backend`), sizes the paged KV cache from what the
graphs declare, asks the executor to capture CUDA graphs of the decode step where it can, hands
each step's host-built metadata to the executor (which copies it into persistent device buffers,
`step_inputs.StepBuffers`, or replays a graph), and hands logits back on the host for sampling.
It knows no backend's insides: everything device- or kernel-specific is the executor's.
"""

from __future__ import annotations

import logging

import torch

from .artifact import Artifact
from .cuda_graphs import CaptureReport
from .executor import Executor, KVCacheSpec, resolve_backend
from .slot_program import LaunchTime
from .step_inputs import StepBuffers, StepInputs, build_step_inputs  # noqa: F401  (re-exported)
from .torch_executor import TorchExecutor
from .triton_executor import TritonExecutor

log = logging.getLogger("llmc")


def make_executor(backend: str, artifact: Artifact, device: torch.device, kv: KVCacheSpec,
                  kernels: str, step_plans: bool = True) -> Executor:
    if backend == "triton":
        return TritonExecutor(artifact, device, kv)
    return TorchExecutor(artifact, device, kv, kernels, step_plans)


class ModelRunner:
    """Runs the artifact's prefill and decode graphs against one paged KV cache.

    cuda_graphs: None captures the decode step on a GPU when the backend allows it (vLLM's
    default), True asks for it (and says once why it cannot where it cannot), False never does.
    """

    def __init__(self, artifact: Artifact, num_blocks: int, block_size: int, backend: str = "torch",
                 kernels: str = "auto", device: str = "auto", cuda_graphs: bool | None = None,
                 max_num_seqs: int = 64, step_plans: bool = True):
        self.artifact = artifact
        self.backend, self.device = resolve_backend(backend, artifact, device)
        cache_type = artifact.graphs["prefill"].node_map()["kv_cache"].type
        kv = KVCacheSpec.from_graph_type(cache_type, num_blocks, block_size)
        self.executor = make_executor(self.backend, artifact, self.device, kv, kernels, step_plans)
        self.buffers = StepBuffers(self.device)
        self.graph_error: str | None = None
        self.graph_report = self._capture(cuda_graphs, max_num_seqs, num_blocks, block_size)

    def _capture(self, wanted: bool | None, max_num_seqs: int, num_blocks: int,
                 block_size: int) -> CaptureReport | None:
        if wanted is False:
            return None
        if self.device.type != "cuda" or not self.executor.graph_safe:
            if wanted:
                why = "without a CUDA GPU there is nothing to capture" if self.device.type != "cuda" else \
                    f"the {self.backend} backend's ops wait for the host, which a CUDA graph cannot hold"
                log.info("--cuda-graphs does nothing here: %s; every step runs eagerly", why)
            return None
        context = self.artifact.config.max_position_embeddings
        max_blocks = min(num_blocks, -(-context // block_size))
        try:
            report = self.executor.capture_decode_graphs(max_num_seqs, max_blocks)
        except RuntimeError as exc:     # a kernel that cannot be captured: serve eagerly, and say why
            self.executor.graphs, self.graph_error = None, f"{type(exc).__name__}: {exc}"
            log.warning("capturing CUDA graphs of the decode step failed (%s); every step runs eagerly",
                        self.graph_error)
            return None
        log.info("%s", report.describe())
        return report

    @property
    def cuda_graphs(self) -> bool:
        """Whether pure-decode steps replay captured CUDA graphs."""
        return self.executor.graphs is not None

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.executor.kv_cache

    @property
    def kernels(self) -> str:
        """What computes the ops: 'native' or 'reference' (torch backend), 'triton'."""
        return getattr(self.executor, "kernels", self.backend)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write block copies (all layers, K and V) before a step writes."""
        if copies:
            src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in zip(*copies))
            self.executor.copy_blocks(src, dst)

    def run(self, entry: str, step: StepInputs) -> torch.Tensor:
        """Logits [S, vocab] (fp32, on the host) of the last computed token of each sequence."""
        return self.executor.step(entry, step, self.buffers).cpu()

    def run_timed(self, entry: str, step: StepInputs) -> tuple[torch.Tensor, list[LaunchTime]]:
        """`run` launched eagerly, and each launch's wall time (for profiles; slower than `run`)."""
        logits, timings = self.executor.run_timed(entry, self.executor.on_device(step, self.buffers))
        return logits.cpu(), timings


def allocate_kv_cache(cache_type, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed CPU cache of the layout the graphs declare, [L, 2, NB, KVH, BS, D] (for tools)."""
    return KVCacheSpec.from_graph_type(cache_type, num_blocks, block_size).allocate(torch.device("cpu"))
