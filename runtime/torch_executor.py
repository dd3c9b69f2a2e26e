"""The `torch` executor: every op through torch (aten) calls, llmc's native CPU kernels where they fit.

It is the CPU runtime and the numeric reference of the triton executor. On the CPU the op table
is the native one (kernels/native_ops.py) or the torch refs, as `kernels` asks; on another device
the refs run there (the native kernels are CPU code). Weights move to the device once; with the
native kernels the GEMMs then take them as kernels/native_ops.py's prepare_weights lays them out, once.
With the native kernels, a graph whose ops all have plan kernels (prefill and decode) runs as one
step plan (step_plan.py): one native call per step in place of a Python launch per op, the same
kernels on the same work, so the same numbers; `step_plans=False` keeps every graph op by op.
"""

from __future__ import annotations

import logging

import torch

from llmc.compiler.ir import Graph
from llmc.kernels.native_ops import choose_op_impls, prepare_weights
from llmc.kernels.torch_ops import OP_IMPLS

from .artifact import Artifact
from .executor import Executor, KVCacheSpec
from .slot_program import SlotProgram
from .step_plan import NotPlannable, StepPlanProgram, lower_step_plan
from .torch_backend import TorchProgram

log = logging.getLogger("llmc")


class TorchExecutor(Executor):
    backend = "torch"
    graph_safe = False      # the torch refs read lengths and slots on the host (.tolist(), masks)

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec, kernels: str = "auto",
                 step_plans: bool = True):
        super().__init__(artifact, device, kv)
        if device.type == "cpu":
            impls, self.kernels = choose_op_impls(kernels)
        else:
            impls, self.kernels = dict(OP_IMPLS), "reference"
        weights = {name: w.to(device) for name, w in artifact.weights.items()}
        if self.kernels == "native":        # the GEMMs' weight layouts, decided once for both graphs
            weights = prepare_weights(artifact.graphs.values(), weights)
        if device.type == "cpu":
            # Own memory: a tensor as the artifact loaded it is a view of the weights file's mapping,
            # which stays mapped (its pages resident) while any such view lives.
            weights = {name: w.clone() if isinstance(w, torch.Tensor) else w for name, w in weights.items()}
        plans = step_plans and self.kernels == "native" and device.type == "cpu"
        self.programs = {entry: self._program(g, weights, impls, kv.block_size, plans)
                         for entry, g in artifact.graphs.items()}

    @staticmethod
    def _program(graph: Graph, weights: dict, impls: dict, block_size: int,
                 plans: bool) -> SlotProgram | StepPlanProgram:
        """The graph as one native step plan where every op lowers to one (with `plans`), else op by op."""
        if plans:
            try:
                return lower_step_plan(graph, weights, block_size)
            except NotPlannable as why:
                log.debug("graph %s runs op by op: %s", graph.name, why)
        return TorchProgram(graph, weights, impls)
