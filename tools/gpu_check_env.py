"""The device check's first second: every module any of its parts will need, imported now.

A GPU machine has no network, so a package that is missing there must travel as a wheel; the
check finds that out before it compiles anything, not after a dtype's minutes of measurements.
`require_packages` imports the check's own modules (and so everything they import: typer, jinja2,
tokenizers, safetensors, ...), triton when it is the candidate, transformers when a baseline is
asked for (its continuous manager needs 4.56 or newer), and the `gguf` package the model loader
reads; a missing one becomes one sentence naming it and the commands that bring it. Only the
standard library is imported at this module's top, so the sentence comes even where torch's
neighbours are missing.
"""

from __future__ import annotations

import importlib
import re
from argparse import Namespace

# a module's top-level name -> the distribution pip downloads, where the two differ
DISTRIBUTIONS = {"jinja2": "Jinja2", "yaml": "PyYAML", "google": "protobuf", "sklearn": "scikit-learn"}
CONTINUOUS_MIN = (4, 56)         # transformers' continuous-batching manager (ContinuousBatchingManager)


class MissingPackage(Exception):
    """A package the check needs is not importable; the message says how to bring it."""


def wheel_advice(module: str) -> str:
    """One sentence: `module` is missing, and the commands that bring it to a machine with no network."""
    top = module.split(".")[0]
    if top == "gguf":
        return ("the check needs the pure-Python gguf package, which is not installed; put the bundle's copy on the "
                "path (PYTHONPATH=\"$PWD/gpu_bundle/site\", written by `python -m llmc.tools.gpu_check prepare`)")
    if top == "llmc":
        return (f"llmc's module {module} is not importable; map the llmc.* packages onto the checkout's folders "
                f"(.gpu_path, as the README's GPU section shows) or `pip install --no-deps -e .`")
    dist = DISTRIBUTIONS.get(top, top)
    return (f"the check needs the Python package {dist}, which is not installed; bring it as a wheel: "
            f"`pip download --no-deps --only-binary=:all: --python-version 3.12 {dist} -d wheels/` on a machine "
            f"with pip's network, carry wheels/ here, then `pip install --no-deps --no-index wheels/*.whl`")


def needed_modules(args: Namespace) -> list[str]:
    """What the parts `args` asks for import, named so a missing package shows before any of them runs."""
    modules = ["torch", "numpy", "gguf", "llmc.tools.gpu_check_run", "llmc.tools.gpu_check_parts",
               "llmc.tools.gpu_check_hf", "llmc.tools.bench", "llmc.tools.profile_steps", "llmc.runtime.engine",
               "llmc.runtime.tokenizer", "llmc.models.hf_loader"]
    if args.backend == "triton":
        modules += ["triton", "llmc.runtime.triton_executor"]
    if args.hf:
        modules += ["transformers", "llmc.tools.bench_hf"]
    return modules


def require_packages(args: Namespace) -> dict[str, str]:
    """Import every needed module now; {package: version} of the ones the table names. MissingPackage
    (one sentence with the wheel commands) for a missing package, or a transformers too old for --hf."""
    for module in needed_modules(args):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise MissingPackage(wheel_advice(exc.name or module)) from None
    versions = {name: _version(name) for name in ("torch", "triton", "transformers")}
    if "continuous" in getattr(args, "hf", []) and _release(versions["transformers"]) < CONTINUOUS_MIN:
        raise MissingPackage(f"--hf continuous needs transformers {'.'.join(map(str, CONTINUOUS_MIN))} or newer "
                             f"(its continuous-batching manager), found {versions['transformers']}; bring a newer "
                             f"wheel as for a missing package, or ask for --hf static")
    return versions


def _version(name: str) -> str:
    try:
        return importlib.import_module(name).__version__
    except ImportError:
        return "absent"


def _release(version: str) -> tuple[int, ...]:
    """'4.56.1' -> (4, 56, 1); an absent or unreadable version sorts first."""
    numbers = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(n) for n in numbers) or (0,)
