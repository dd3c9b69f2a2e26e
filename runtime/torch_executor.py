"""The `torch` executor: every op through torch (aten) calls, llmc's native CPU kernels where they fit.

It is the CPU runtime and the numeric reference of the triton executor. On the CPU the op table
is the native one (kernels/native_ops.py) or the torch refs, as `kernels` asks; on another device
the refs run there (the native kernels are CPU code). Weights move to the device once; with the
native kernels the GEMMs then take them as kernels/native_ops.py's prepare_weights lays them out, once,
and the elementwise and row-wise ops run the artifact's generated C++ (cpu_program.py: checked,
built once per machine), one call per CPU unit. With the native kernels, a graph whose ops all have plan kernels (prefill and decode) runs as one
step plan (step_plan.py): one native call per step in place of a Python launch per op, the same
kernels on the same work, so the same numbers; `step_plans=False` keeps every graph op by op. A
graph the plan cannot take runs op by op, said once at INFO (the node and why) and kept in the
executor's capabilities, which `llmc profile` and `llmc inspect` print.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from llmc.compiler.ir import Graph
from llmc.kernels.native_ops import (ACTIVATION_CHOICES, KERNEL_CHOICES, choose_activations, choose_op_impls,
                                     described_kernels, prepare_weights)

from .artifact import Artifact
from .cpu_program import CpuKernels, load_cpu_kernels, op_by_op_program
from .executor import Capabilities, Executor, ExecutorOptions, GraphRun, KVCacheSpec
from .sampling_params import RequestError
from .slot_program import SlotProgram
from .step_plan import NotPlannable, StepPlanProgram, lower_step_plan
from .weight_arena import place_weights, read_order

log = logging.getLogger("llmc")


@dataclass(frozen=True)
class TorchOptions(ExecutorOptions):
    """kernels: 'native' (llmc's C++ CPU kernels; a build failure is an error), 'reference' (the torch
    refs) or 'auto' (native where they build, else the refs with one warning). step_plans: with the
    native kernels, each graph whose ops all have plan kernels runs as one native call per step.
    activations: what the native kernels' quantized GEMMs multiply: 'int8' (x quantized per block of
    32, integer dot products), 'bf16' (int8, but a prompt's GEMMs of 32 or more tokens on x and the
    weight dequantized to bf16, AMX-BF16: kernels/cpu/amx_dequant_gemm.h), 'f32' (int8, but a prompt's
    GEMMs of 16 or more tokens on x and the weight dequantized to fp32: kernels/cpu/f32_dequant_gemm.h),
    'float', or 'auto' (bf16 where the CPU has AMX-BF16, int8 where it has AVX512-VNNI or AVX2's integer
    dot products: kernels/native_ops.choose_activations)."""

    kernels: str = "auto"
    step_plans: bool = True
    activations: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernels not in KERNEL_CHOICES:
            raise RequestError(f"kernels {self.kernels!r} is unknown; choose one of {', '.join(KERNEL_CHOICES)}")
        if not isinstance(self.step_plans, bool):
            raise RequestError(f"backend option step_plans={self.step_plans!r} must be true or false")
        if self.activations not in ACTIVATION_CHOICES:
            raise RequestError(f"activations {self.activations!r} is unknown; choose one of "
                               f"{', '.join(ACTIVATION_CHOICES)}")


class TorchExecutor(Executor):
    backend = "torch"
    options_type = TorchOptions
    graph_safe = False      # the torch refs read lengths and slots on the host (.tolist(), masks)
    auto_rank = 0           # auto's last resort: it runs any artifact anywhere

    @classmethod
    def place(cls, artifact: Artifact, device: str) -> torch.device:
        """The CPU unless `device` is cuda (then it is the GPU reference of the triton backend)."""
        return torch.device("cuda" if device == "cuda" else "cpu")

    @classmethod
    def auto_picks(cls, artifact: Artifact, device: str) -> bool:
        return True

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec, options: TorchOptions | None = None):
        super().__init__(artifact, device, kv, options)
        if device.type == "cpu":
            impls, self.kernels = choose_op_impls(self.options.kernels)
        else:
            impls, self.kernels = {}, "reference"
        weights = {name: w.to(device) for name, w in artifact.weights.items()}
        self.described_kernels = self.kernels
        if self.kernels == "native":        # the GEMMs' weight layouts, decided once for both graphs
            activations = choose_activations(self.options.activations)
            weights = prepare_weights(artifact.graphs.values(), weights, activations)
            self.described_kernels = described_kernels(weights, activations)
        if device.type == "cpu":
            # Own memory: a tensor as the artifact loaded it is a view of the weights file's mapping,
            # which stays mapped (its pages resident) while any such view lives. One arena, in the
            # order a decode step reads them, on huge pages where the OS grants them (weight_arena.py).
            decode = artifact.graphs.get("decode", next(iter(artifact.graphs.values())))
            weights = place_weights(weights, read_order(decode))
        no_plans = self._why_no_plans()
        cpu = load_cpu_kernels(artifact) if self.kernels == "native" else None      # the generated C++ units
        for entry, graph in artifact.graphs.items():
            self.programs[entry], self.graph_runs[entry] = self._program(entry, graph, weights, impls, kv.block_size,
                                                                         no_plans, cpu)

    def capabilities(self) -> Capabilities:
        """The base's, its kernels saying what the quantized GEMMs' activations are ('native, int8 activations')."""
        return replace(super().capabilities(), kernels=self.described_kernels)

    def _why_no_plans(self) -> str:
        """Why no graph can be a step plan here, or '' where each graph may be one."""
        if not self.options.step_plans:
            return "step plans are off"
        if self.device.type != "cpu":
            return f"step plans are native CPU code, this runs on {self.device.type}"
        if self.kernels != "native":
            return f"step plans need the native kernels, these are the {self.kernels} ones"
        return ""

    @staticmethod
    def _program(entry: str, graph: Graph, weights: dict, impls: dict, block_size: int,
                 no_plans: str, cpu: CpuKernels | None) -> tuple[SlotProgram | StepPlanProgram, GraphRun]:
        """The graph as one native step plan where every op lowers to one, else op by op (over its CPU
        units with the native kernels); and how it runs. A graph that could be a plan but is not is a
        slower path: said once, at INFO."""
        if no_plans:
            return op_by_op_program(graph, weights, impls, cpu), GraphRun(entry, False, no_plans)
        try:
            return lower_step_plan(graph, weights, block_size, kernels=cpu), GraphRun(entry, True)
        except NotPlannable as why:
            log.info("graph %s runs op by op, not as one step plan: %s", entry, why)
            return op_by_op_program(graph, weights, impls, cpu), GraphRun(entry, False, str(why))
