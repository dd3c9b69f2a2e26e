"""Shared fixtures: tiny compiled artifacts of each family, cached per test session; the run's
report (what tests measured, shown at the end of the run and kept in test-report.txt)."""

from __future__ import annotations

import os
import sys
import time
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


@pytest.fixture
def threads(request):
    """torch's intra-op threads set to the test's parameter (`indirect=["threads"]`) for one test."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
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


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct compiled with the defaults, once for every module that serves it."""
    from llmc.compiler.driver import compile_model

    return compile_model(None, tmp_path_factory.mktemp("smollm2") / "artifact")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:          # the marker, not a keyword: a folder named gpu is a keyword too
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


ALL_FAMILIES = list(FAMILIES)

# ------------------------------------------------------------------ the run's report

REPORT_FILE = "test-report.txt"         # at the repository root; git-ignored (README, "Tests")
REPORT_LINES = pytest.StashKey[list]()


@pytest.fixture
def report(request):
    """`report(line)`: a figure a test measured (a divergence step, a near tie, a quality figure),
    printed in the "llmc test report" section at the end of the run and written to REPORT_FILE,
    where CI shows it; a print() would be swallowed by pytest's capture of passing tests."""
    lines = request.config.stash.setdefault(REPORT_LINES, [])
    return lambda line: lines.append(f"{request.node.nodeid}: {line}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The report's lines, if any test reported: on the terminal and in REPORT_FILE (replaced)."""
    lines = config.stash.get(REPORT_LINES, [])
    if not lines:
        return
    path = config.rootpath / REPORT_FILE
    terminalreporter.write_sep("=", "llmc test report")
    for line in lines:
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"(also written to {path.name})")
    header = f"llmc test report, {time.strftime('%Y-%m-%d %H:%M:%S')}, pytest exit status {int(exitstatus)}"
    path.write_text("\n".join([header, *lines]) + "\n")
