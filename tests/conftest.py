"""Shared fixtures: tiny compiled artifacts of each family, cached per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # test helpers: tiny_models, tolerances
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU tensors; read when a kernel is decorated,
    # so it is set before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import FAMILIES, build_hf_model, write_hf_folder  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built():
    """Build the native CPU kernels once, first, so the one-time build line (~30 s on a fresh
    machine) lands in no test's captured output. Without a compiler the native tests fail on
    their own and `auto` engines fall back to the refs."""
    from llmc.kernels.native import NativeBuildError, load_native_kernels

    try:
        load_native_kernels()
    except NativeBuildError:
        pass


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on busy shared cores OpenMP waits cost ~20x
    (modules of tiny-model engine runs use it: `pytestmark = pytest.mark.usefixtures(...)`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """family name -> (transformers model, HF folder, compiled artifact path); built once each."""
    from llmc.compiler.driver import compile_model

    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            model = build_hf_model(family)
            folder = write_hf_folder(model, root / "hf")
            cache[family] = (model, folder, compile_model(folder, root / "artifact"))
        return cache[family]

    return get


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:          # the marker, not a keyword: a folder named gpu is a keyword too
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


ALL_FAMILIES = list(FAMILIES)
