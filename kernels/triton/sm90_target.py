"""The sm_90 target (H100/H200) without a GPU: a Triton driver that compiles for it and launches
nothing, and what CUDA would say about each compiled kernel's resources, read from its cubin.

kernels/triton/aot_compile.py installs `NoLaunchDriver`, then Triton's own CompiledKernel code
runs as on a GPU: `_init_handles` asks the driver's `utils` for the device's shared-memory limit
(refusing a kernel over it with Triton's OutOfResources) and for the loaded kernel's registers and
local memory (n_regs, n_spills), which `SM90Resources.load_binary` reads with the wheel's
cuobjdump. `kernel_resources` turns them into a verdict: over the shared-memory limit, or any
register spilled (ptxas -v's own count: Triton's n_spills counts a local array too), fails.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

SM90 = ("cuda", 90, 32)             # Triton's GPUTarget(backend, arch, warp size)
# Shared memory one block may opt into on sm_90 (H100/H200): 227 KiB, the CUDA C++ Programming
# Guide's compute-capability-9.0 table; CUDA's CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
# which Triton's driver reads as max_shared_mem and checks every kernel's metadata.shared against.
SM90_SHARED_OPTIN = 227 * 1024
SM90_REGISTERS = 64 * 1024          # 32-bit registers of an SM, and the most one block may take


class NoLaunchDriver:
    """Triton's driver for a GPU that is not here: it names the target and launches nothing; its
    `utils` answer what CUDA would about a compiled kernel (SM90Resources)."""

    def __init__(self, target):
        self.target, self.utils = target, SM90Resources()

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    @staticmethod
    def launcher_cls(src, metadata) -> Callable:
        return _no_launch


def _no_launch(*args, **kwargs) -> None:
    raise RuntimeError("aot_compile's driver compiles kernels and launches none")


class SM90Resources:
    """What CUDA's driver tells Triton about an sm_90 device and a loaded kernel, read from the
    cubin instead (Triton's CompiledKernel._init_handles asks these two, then sets n_regs, n_spills
    and checks metadata.shared against max_shared_mem, as on a GPU)."""

    def get_device_properties(self, device) -> dict[str, int]:
        return {"max_shared_mem": SM90_SHARED_OPTIN, "max_num_regs": SM90_REGISTERS, "warpSize": 32}

    def load_binary(self, name: str, cubin: bytes, shared: int, device) -> tuple[int, int, int, int, int]:
        """(module, function, n_regs, n_spills, n_max_threads) as driver.c's load_binary: n_spills
        is CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4, the local memory of a thread, which cuobjdump
        shows as the stack frame (spilled registers) plus any other local memory."""
        from triton import knobs

        with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
            file.write(cubin)
            file.flush()
            usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", file.name], check=True,
                                   capture_output=True, text=True).stdout
        found = re.search(rf"Function {re.escape(name)}:\s+REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
        if found is None:
            raise RuntimeError(f"cuobjdump -res-usage names no function {name}: {usage[-400:]}")
        registers, stack, local = map(int, found.groups())
        return 0, 0, registers, (stack + local) // 4, max_threads(registers)


def max_threads(registers: int) -> int:
    """CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK for a kernel of `registers` per thread on sm_90:
    registers are given to a warp in units of 256, from 64 Ki per block; at most 1024 threads."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(1024, SM90_REGISTERS // max(per_warp, 1) * 32)


def kernel_resources(kernel) -> tuple[dict[str, int], str | None]:
    """(Compile's resource fields, why `kernel` cannot run as compiled or None) for a CompiledKernel
    for sm_90: shared memory over the block's limit (Triton's own OutOfResources check) or any
    register spilled to local memory fails. Triton's n_spills counts all local memory, a local
    array too (sin/cos's range reduction keeps 28 bytes there, touched only for huge arguments),
    so a kernel with any takes ptxas's own count of spill stores."""
    from triton.runtime.errors import OutOfResources

    used = {"shared": kernel.metadata.shared}
    try:
        kernel._init_handles()
    except OutOfResources as exc:
        return used, str(exc)
    used.update(registers=kernel.n_regs, local=4 * kernel.n_spills,
                spilled=register_spills(kernel) if kernel.n_spills else 0)
    if used["spilled"]:
        return used, (f"ptxas spills {used['spilled']} bytes a thread of registers to local memory at "
                      f"{kernel.n_regs} registers: take a smaller tile, fewer stages or more warps for this dtype")
    return used, None


def register_spills(kernel) -> int:
    """Bytes of spill stores ptxas -v reports for `kernel`'s PTX, compiled again as Triton's
    make_cubin compiles it (same tool and flags)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    fmad = [] if kernel.metadata.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory(prefix="llmc-ptxas-") as scratch:
        ptx = Path(scratch) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([knobs.nvidia.ptxas.path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(SM90[1])}", str(ptx), "-o", f"{ptx}.o"],
                             check=True, capture_output=True, text=True).stderr
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if found is None:
        raise RuntimeError(f"ptxas -v reported no spill counts: {log[-400:]}")
    return int(found.group(1))
