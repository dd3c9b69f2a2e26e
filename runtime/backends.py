"""The executor registry: every backend by name, and the choice of one for an artifact on a device.

A backend is an `Executor` subclass (executor.py) that says its name, its options (a frozen
dataclass that validates itself), where it runs (`place`, and whether `--backend auto` takes it)
and its KV bytes per block. `register_backend` adds one; the built-in ones are registered at the
bottom of this file, one visible list. The engine, the engine loop, the server and the CLI carry
a backend's options as one opaque mapping, `backend_options`; only the chosen backend's options
dataclass reads it.

An option the chosen backend does not have but another registered backend does (`--kernels native
--backend triton`) is ignored with one INFO line, as vLLM ignores a platform-specific setting on a
platform without it (its CPU platform turns CUDA graphs off and logs it rather than failing): with
`--backend auto` the user cannot know which backend runs, and the option was valid for the one it
was meant for. An option no backend has, or a bad value, is a RequestError: one sentence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from llmc.compiler.ir import TensorType

from .artifact import Artifact
from .executor import DEVICES, Executor, ExecutorOptions, KVCacheSpec
from .sampling_params import RequestError
from .torch_executor import TorchExecutor
from .triton_executor import TritonExecutor

log = logging.getLogger("llmc")

BACKENDS: dict[str, type[Executor]] = {}


def register_backend(executor: type[Executor]) -> type[Executor]:
    """Add a backend under its `backend` name (a class decorator too); a name taken is an error."""
    assert executor.backend and executor.backend != "auto", f"{executor.__name__} needs a backend name"
    assert executor.backend not in BACKENDS, f"backend {executor.backend!r} is already registered"
    BACKENDS[executor.backend] = executor
    return executor


def backend_names() -> tuple[str, ...]:
    """What --backend takes: 'auto' and every registered backend."""
    return ("auto", *BACKENDS)


def check_backend_name(backend: str) -> None:
    if backend not in backend_names():
        raise RequestError(f"backend {backend!r} is unknown; choose one of {', '.join(backend_names())}")


def _options_for(executor: type[Executor], given: Mapping[str, object]) -> tuple[ExecutorOptions, tuple[str, ...]]:
    """`executor`'s options from `given`, and the names in `given` it does not have (another backend's)."""
    known = {name for cls in BACKENDS.values() for name in cls.options_type.names()}
    if unknown := [name for name in given if name not in known]:
        raise RequestError(f"backend option {unknown[0]!r} is unknown; the backends take {', '.join(sorted(known))}")
    own = executor.options_type.names()
    options = executor.options_type(**{name: value for name, value in given.items() if name in own})
    return options, tuple(name for name in given if name not in own)


def check_backend_options(given: Mapping[str, object]) -> None:
    """Every option is one some backend has, with a value valid there (checked before any artifact
    loads, whatever backend `auto` will choose); RequestError otherwise."""
    for executor in BACKENDS.values():
        _options_for(executor, given)


def resolve_backend(backend: str, artifact: Artifact, device: str = "auto") -> tuple[str, torch.device]:
    """The backend and device a request for `backend` on `device` means here; RequestError if it cannot run.

    auto: the highest-ranked backend that takes the artifact here (triton on a GPU when the
    artifact has kernels, torch on the CPU elsewhere). A named backend's `place` says where it
    runs, or why it cannot.
    """
    check_backend_name(backend)
    if device not in DEVICES:
        raise RequestError(f"device {device!r} is unknown; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RequestError("device cuda was asked for but torch sees no CUDA GPU here; use --device cpu")
    if backend == "auto":
        ranked = sorted(BACKENDS.values(), key=lambda cls: -cls.auto_rank)
        backend = next((cls.backend for cls in ranked if cls.auto_picks(artifact, device)), "")
        if not backend:
            raise RequestError(f"no backend runs {artifact.path} on device {device}; name one with --backend")
    return backend, BACKENDS[backend].place(artifact, device)


@dataclass(frozen=True)
class BackendChoice:
    """A backend chosen for one artifact: its executor class, the device, its validated options."""

    executor: type[Executor]
    device: torch.device
    options: ExecutorOptions
    ranks: object = None        # the tensor-parallel ranks (runtime/tensor_parallel.Ranks) this is rank 0 of

    @property
    def name(self) -> str:
        return self.executor.backend

    def kv_bytes_per_block(self, cache_type: TensorType, block_size: int) -> int:
        """Bytes one block of a cache of `cache_type` (the graphs' declaration) takes in this backend."""
        return self.executor.kv_bytes_per_block(KVCacheSpec.from_graph_type(cache_type, 1, block_size))

    def build(self, artifact: Artifact, kv: KVCacheSpec) -> Executor:
        """The executor; with ranks (or a sharded artifact), rank 0's behind the step broadcast."""
        from .tensor_parallel import plan_size, rank_executor

        if self.ranks is None and plan_size(artifact) == 1:
            return self.executor(artifact, self.device, kv, self.options)
        return rank_executor(self, artifact, kv, self.ranks)


def choose_backend(backend: str, artifact: Artifact, device: str = "auto",
                   options: Mapping[str, object] | None = None, ranks: object = None) -> BackendChoice:
    """The backend, device and options `backend`, `device` and `options` mean for `artifact` here, on
    the tensor-parallel `ranks` if given; another backend's options are ignored with one INFO line
    (module docstring)."""
    name, where = resolve_backend(backend, artifact, device)
    executor = BACKENDS[name]
    own, ignored = _options_for(executor, options or {})
    if ignored:
        owners = sorted({cls.backend for cls in BACKENDS.values() for n in ignored if n in cls.options_type.names()})
        log.info("the %s backend has no option %s (an option of %s); ignoring it", name, ", ".join(ignored),
                 " and ".join(owners))
    return BackendChoice(executor, where, own, ranks)


# The built-in backends, in the order --backend lists them.
register_backend(TorchExecutor)
register_backend(TritonExecutor)
