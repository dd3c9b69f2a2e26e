"""The `torch` executor: every op through torch (aten) calls, llmc's native CPU kernels where they fit.

It is the CPU runtime and the numeric reference of the triton executor. On the CPU the op table
is the native one (kernels/native_ops.py) or the torch refs, as `kernels` asks; on another device
the refs run there (the native kernels are CPU code). Weights move to the device once; with the
native kernels the GEMMs then take them as kernels/native_ops.py's prepare_weights lays them out, once.
"""

from __future__ import annotations

import torch

from llmc.kernels.native_ops import choose_op_impls, prepare_weights
from llmc.kernels.torch_ops import OP_IMPLS

from .artifact import Artifact
from .executor import Executor, KVCacheSpec
from .torch_backend import TorchProgram


class TorchExecutor(Executor):
    backend = "torch"
    graph_safe = False      # the torch refs read lengths and slots on the host (.tolist(), masks)

    def __init__(self, artifact: Artifact, device: torch.device, kv: KVCacheSpec, kernels: str = "auto"):
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
        self.programs = {entry: TorchProgram(g, weights, impls) for entry, g in artifact.graphs.items()}
