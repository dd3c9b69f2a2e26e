"""Native CPU kernels: the C++ sources in kernels/cpu/, built on first use and loaded as
`torch.ops.llmc.*`.

They are built with torch's C++ extension builder (`-O3 -march=native`, so the 16-lane vectors of
`cpu/vec16.h` become AVX-512, AVX2 or NEON code for the machine at hand) into
`$LLMC_CACHE_DIR/kernels` (default `~/.cache/llmc/kernels`); a later process reuses the build
unless a source changed. Building takes ~15 s once per machine and needs a C++ compiler. Each
launcher in kernels/*.py states its kernel's contract; the torch `_ref` beside it is the meaning.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).parent / "cpu"
EXTENSION_NAME = "llmc_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded on this machine."""


def cache_dir() -> Path:
    root = os.environ.get("LLMC_CACHE_DIR") or Path.home() / ".cache" / "llmc"
    return Path(root) / "kernels" / f"torch-{torch.__version__}"


def native_kernels_loaded() -> bool:
    return hasattr(torch.ops.llmc, "paged_attention")


def load_native_kernels() -> None:
    """Build (if needed) and load the kernels into this process; a second call does nothing."""
    if native_kernels_loaded():
        return
    from torch.utils.cpp_extension import load

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    try:
        load(name=EXTENSION_NAME, sources=[str(p) for p in sorted(SOURCE_DIR.glob("*.cpp"))],
             extra_cflags=CFLAGS, extra_include_paths=[str(SOURCE_DIR)], build_directory=str(build),
             is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise NativeBuildError(f"building the native CPU kernels in {build} failed ({first_line}); "
                               "install a C++ compiler (g++) or run with --kernels reference") from None
