"""The registry of model families: name -> Family (models/families/family.py).

Every question "which family is this?" is answered here, from config.json's `architectures`
(or `model_type` when that is absent), GGUF's `general.architecture`, or a ModelConfig's
`architecture`; an unknown one is a ModelError naming the families llmc has.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelError
from . import gemma, llama, mistral, olmo2, phi3, qwen2, qwen3
from .family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                                   gemma.GEMMA2, gemma.GEMMA3, phi3.FAMILY, olmo2.FAMILY)}


def register(family: Family) -> Family:
    """Add `family` to the registry; ValueError if its name or one of its architectures is taken."""
    taken = {a for f in FAMILIES.values() for a in f.hf_architectures}
    clash = set(family.hf_architectures) & taken
    if family.name in FAMILIES or clash:
        raise ValueError(f"family {family.name!r} clashes with a registered one ({sorted(clash) or family.name})")
    FAMILIES[family.name] = family
    return family


def supported() -> str:
    """The families and their HF architectures, as error messages list them."""
    return ", ".join(f"{f.name} ({'/'.join(f.hf_architectures)})" for f in FAMILIES.values())


def family_of(architecture: str) -> Family:
    """The family whose HF architectures include `architecture` (a ModelConfig's)."""
    for family in FAMILIES.values():
        if architecture in family.hf_architectures:
            return family
    raise ModelError(f"architecture {architecture!r} is not supported; llmc compiles the families {supported()}")


def family_for_hf(raw: dict[str, Any]) -> tuple[Family, str]:
    """The family of a config.json dict and the architecture it records: `architectures[0]`, or
    when the list is absent, the family's first architecture for a known `model_type`."""
    archs = raw.get("architectures") or []
    if archs:
        for family in FAMILIES.values():
            if archs[0] in family.hf_architectures:
                return family, archs[0]
        raise ModelError(f"architecture {archs[0]!r} in config.json is not supported; "
                         f"llmc compiles the families {supported()}")
    model_type = raw.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family, family.architecture
    raise ModelError(f"config.json names no architecture and model_type {model_type!r}, which is not "
                     f"supported; llmc compiles the families {supported()}")


def family_for_gguf(architecture: Any) -> Family:
    """The family that loads GGUF `general.architecture` = `architecture`."""
    for family in FAMILIES.values():
        if family.gguf_architecture is not None and architecture == family.gguf_architecture:
            return family
    known = ", ".join(repr(f.gguf_architecture) for f in FAMILIES.values() if f.gguf_architecture)
    raise ModelError(f"GGUF architecture {architecture!r} is not supported; llmc's families "
                     f"{', '.join(FAMILIES)} load GGUF architectures {known}")
