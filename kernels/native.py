"""Native CPU kernels: the C++ sources in kernels/cpu/, built on first use and loaded as
`torch.ops.llmc.*`.

They are built with torch's C++ extension builder (`-O3 -march=native`, so the 16-lane vectors of
`cpu/vec16.h` become AVX-512, AVX2 or NEON code for the machine at hand) into
`$LLMC_CACHE_DIR/kernels` (default `~/.cache/llmc/kernels`), one folder per torch version and CPU
type; a later process reuses the build unless a source changed. Building takes ~30 s once per machine and needs a C++ compiler. Each
launcher in kernels/*.py states its kernel's contract; the torch `_ref` beside it is the meaning.

The step plan's `step_plan_isa.h` is not a source file: it is rendered from kernels/step_plan_isa.py
into the build folder before every build (rewritten only when its text changes, so the build's
header tracking rebuilds what includes it), and a loaded build whose description hash differs from
this checkout's is refused with NativeBuildError.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .amx import announce_gemm_path, announce_qgemm_path
from .step_plan_isa import STEP_PLAN_ISA
from .step_plan_isa_header import HEADER_NAME, render_header

SOURCE_DIR = Path(__file__).parent / "cpu"
EXTENSION_NAME = "llmc_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]    # libgomp.so.1: the process already has torch's, which the step plan's team shares
STALE_LOCK_SECONDS = 600          # a build takes about a minute


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded on this machine."""


def cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags: a -march=native build is only good
    for CPUs with the same features, so builds for different CPUs live apart."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = platform.processor()
    facts = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    return hashlib.sha256("\n".join([platform.machine(), *facts]).encode()).hexdigest()[:12]


def cache_root() -> Path:
    """llmc's per-user cache folder: `$LLMC_CACHE_DIR`, else ~/.cache/llmc."""
    return Path(os.environ.get("LLMC_CACHE_DIR") or Path.home() / ".cache" / "llmc")


def cache_dir() -> Path:
    return cache_root() / "kernels" / f"torch-{torch.__version__}" / f"cpu-{cpu_tag()}"


def clear_stale_lock(build: Path, older_than: float = STALE_LOCK_SECONDS) -> None:
    """torch's extension builder waits, forever, while the build folder holds a `lock` file; a
    build stopped midway (Ctrl-C) leaves one behind. A build takes about a minute, so a lock older
    than `older_than` seconds is such a leftover: remove it (and say so)."""
    lock = build / "lock"
    try:
        if time.time() - lock.stat().st_mtime > older_than:
            logging.getLogger("llmc").warning("removing %s, left behind by a build that was stopped", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def write_isa_header(build: Path) -> Path:
    """The step plan's generated header in `build`, for this checkout's description; left untouched
    (its time too) when it already says the same."""
    path, text = build / HEADER_NAME, render_header()
    if not path.exists() or path.read_text() != text:
        partial = build / f"{HEADER_NAME}.{os.getpid()}.partial"
        partial.write_text(text)
        partial.replace(path)          # whole or not at all, should another process be building
    return path


def check_isa_hash(built: str, build: Path, described: str = STEP_PLAN_ISA.hash()) -> None:
    """NativeBuildError unless the loaded kernels' step plan follows this checkout's description."""
    if built != described:
        raise NativeBuildError(f"the native kernels in {build} were built for step-plan instruction set {built}, "
                               f"not this checkout's {described}; delete that folder to build them again")


def native_module():
    """The loaded native build as a Python module: its pybind11 functions (plan_binding.cpp's run_plan),
    beside the torch.ops it registers. Imported from the library load_native_kernels loaded, once a
    process (sys.modules keeps it)."""
    load_native_kernels()
    if EXTENSION_NAME not in sys.modules:
        path = next(p for p in torch.ops.loaded_libraries if Path(p).name.startswith(EXTENSION_NAME))
        spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[EXTENSION_NAME] = module
    return sys.modules[EXTENSION_NAME]


def loaded_isa_hash() -> str:
    """The description hash the loaded step plan was built from ("none" for a build older than it)."""
    return torch.ops.llmc.step_plan_isa_hash() if hasattr(torch.ops.llmc, "step_plan_isa_hash") else "none"


def native_kernels_loaded() -> bool:
    return hasattr(torch.ops.llmc, "paged_attention")


def load_native_kernels() -> None:
    """Build (if needed) and load the kernels into this process; a second call does nothing."""
    if native_kernels_loaded():
        return
    from torch.utils.cpp_extension import load

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build)
    write_isa_header(build)
    if not any(build.glob(f"{EXTENSION_NAME}*.so")):
        logging.getLogger("llmc").info("building the native CPU kernels into %s (once per machine, about 30 s)", build)
    builder_log = logging.getLogger("torch.utils.cpp_extension")
    level = builder_log.level
    builder_log.setLevel(logging.ERROR)        # its compiler-ABI banner is noise next to our sentence
    try:
        load(name=EXTENSION_NAME, sources=[str(p) for p in sorted(SOURCE_DIR.glob("*.cpp"))],
             extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, extra_include_paths=[str(SOURCE_DIR), str(build)],
             build_directory=str(build),
             is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError):
        compiler = os.environ.get("CXX", "c++")
        raise NativeBuildError(f"the C++ compiler {compiler!r} could not build llmc's native CPU kernels in "
                               f"{build}; install g++, or run with --kernels reference") from None
    finally:
        builder_log.setLevel(level)
    check_isa_hash(loaded_isa_hash(), build)
    announce_gemm_path(logging.getLogger("llmc"))
    announce_qgemm_path(logging.getLogger("llmc"))
