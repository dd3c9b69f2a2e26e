"""Layering (DESIGN 6, STYLE's habits to leave behind): no lower layer imports a higher one.

  models/, passes/, compiler/  import nothing from llmc.kernels (formats, op meanings and launch
                               configs live under compiler/; kernels/ imports them from there)
  runtime bookkeeping          sequence, block manager, scheduler and request import no torch, in
                               their own lines or through what they import

The source is read, not imported: every import statement (at the top or inside a function),
absolute or relative, counts. Generated code held in strings (templates.py's `from llmc.kernels...`
lines) is text, not an import, and does not count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOWER_LAYERS = ("models", "passes", "compiler")
BOOKKEEPING = ("runtime/sequence.py", "runtime/block_manager.py", "runtime/scheduler.py", "runtime/request.py")


def module_name(path: Path) -> str:
    """compiler/codegen/aot.py -> llmc.compiler.codegen.aot (each top folder is a sub-package of llmc)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("llmc", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file, relative ones resolved:
    `import a.b` -> a.b, `from a.b import c` -> a.b, `from .. import c` -> <package two up>.c."""
    name = module_name(path).split(".")
    package = name if path.name == "__init__.py" else name[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            if node.module:
                found.append((node.lineno, f"{base}.{node.module}" if base else node.module))
            else:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def lower_layer_files() -> list[Path]:
    return sorted(p for layer in LOWER_LAYERS for p in (ROOT / layer).rglob("*.py"))


def kernel_imports(path: Path) -> set[str]:
    return {m for _, m in imported_modules(path) if m == "llmc.kernels" or m.startswith("llmc.kernels.")}


@pytest.mark.parametrize("path", lower_layer_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_models_passes_and_compiler_import_nothing_from_kernels(path):
    bad = sorted(kernel_imports(path))
    assert not bad, (f"{path.relative_to(ROOT)} imports {', '.join(bad)}: a lower layer must not import "
                     "llmc.kernels; move what it needs under compiler/ and import it from there")


@pytest.mark.parametrize("file", BOOKKEEPING)
def test_runtime_bookkeeping_has_no_torch_import(file):
    torch_lines = [line for line, m in imported_modules(ROOT / file) if m == "torch" or m.startswith("torch.")]
    assert not torch_lines, f"{file} imports torch (line {torch_lines[0]}); bookkeeping is pure Python (DESIGN 6)"


def test_runtime_bookkeeping_loads_no_torch_through_its_imports():
    modules = ", ".join("llmc.runtime." + Path(f).stem for f in BOOKKEEPING)
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing the bookkeeping modules loads torch: {out.strip()}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """Near-miss and hit: an import inside a function and a relative `from ..kernels` count; a string does not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    source = tmp_path / "compiler" / "codegen" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from llmc.kernels.triton.gemm import pick_config\n"
                      "from ...kernels import quant\nfrom ... import kernels\nfrom ..ir import Graph\n"
                      "TEXT = 'from llmc.kernels.rope import rope_inv_freq'\n")
    assert kernel_imports(source) == {"llmc.kernels.triton.gemm", "llmc.kernels"}
    assert ("llmc.compiler.ir" in {m for _, m in imported_modules(source)})
