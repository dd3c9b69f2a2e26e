"""Generated CPU kernels (compiler/codegen/cpu_lowering.py's translation unit), compiled once per
machine and loaded with ctypes.

Contract: `load_generated(source)` returns a `GeneratedLibrary` whose `address(name)` is the
address of generated function `name` (its ABI: compiler/codegen/cpp.py). The source is built with
the native kernels' toolchain and flags (kernels/native.py: `$CXX` or c++, -O3 -march=native,
kernels/cpu and torch's include folders for c10's BFloat16 and Half) as a plain shared library,
`<cache_dir()>/generated/<sha256>.so`, named by the digest of the source, the flags and the
headers it includes, so a later process (and every artifact with the same kernels) reuses it. A
build is written under a name of its own and renamed into place, so processes building the same
library at once each leave a whole one. Whoever calls an address keeps the library object alive.
A failed build raises NativeBuildError with one sentence.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from .native import SOURCE_DIR, NativeBuildError, cache_dir

FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
HEADERS = ("generated_rows.h", "vec16.h")          # what a generated source includes from kernels/cpu
_LOADED: dict[str, "GeneratedLibrary"] = {}


@dataclass(frozen=True)
class GeneratedLibrary:
    """A loaded build of generated kernels; keep it alive while its functions may be called."""

    path: Path
    lib: ctypes.CDLL

    def address(self, name: str) -> int:
        """The address of generated function `name`, as a plan instruction or run_generated takes it."""
        try:
            return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value
        except AttributeError:
            raise NativeBuildError(f"the generated kernels in {self.path} have no function {name}; delete that "
                                   "file to build them again") from None


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _include_dirs() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [str(SOURCE_DIR), *include_paths()]


def library_digest(source: str) -> str:
    """What names a build: the source, the compiler and flags, and the headers it includes."""
    digest = hashlib.sha256()
    for part in [source, _compiler(), *FLAGS, *((SOURCE_DIR / h).read_text() for h in HEADERS)]:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def _build(source: str, target: Path) -> None:
    """Compile `source` into `target`, whole or not at all."""
    own = target.with_name(f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    cpp, so = own.with_suffix(".cpp"), own.with_suffix(".so")
    cpp.write_text(source)
    command = [_compiler(), *FLAGS, *(f"-I{d}" for d in _include_dirs()), str(cpp), "-o", str(so)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError:
        result = None
    try:
        if result is None or result.returncode != 0:
            errors = [] if result is None else [l for l in result.stderr.splitlines() if "error" in l]
            why = f" ({errors[0].strip()})" if errors else ""
            raise NativeBuildError(f"the C++ compiler {_compiler()!r} could not build the generated CPU kernels in "
                                   f"{target.parent}{why}; install g++, or run with --kernels reference")
        so.replace(target)                              # atomic: a concurrent build's file is whole too
        cpp.replace(target.with_suffix(".cpp"))         # kept beside it, to read
    finally:
        for leftover in (cpp, so):
            leftover.unlink(missing_ok=True)


def load_generated(source: str) -> GeneratedLibrary:
    """`source` built (once per machine) and loaded (once per process); see module docstring."""
    digest = library_digest(source)
    if digest not in _LOADED:
        target = cache_dir() / "generated" / f"{digest}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            logging.getLogger("llmc").info("building generated CPU kernels into %s", target)
            _build(source, target)
        try:
            _LOADED[digest] = GeneratedLibrary(target, ctypes.CDLL(str(target)))
        except OSError as err:
            raise NativeBuildError(f"the generated CPU kernels in {target} cannot be loaded ({err}); delete that "
                                   "file to build them again") from None
    return _LOADED[digest]
