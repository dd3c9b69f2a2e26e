"""The embedded default model, compiled once into the user's cache folder and reused after.

`llmc serve` with no artifact uses it: `$LLMC_CACHE_DIR/artifacts/llmc-<version>/<name>` (default
cache ~/.cache/llmc). One folder per llmc version, so an upgrade never loads an artifact an
older compiler wrote; a cached artifact that fails verification, or that other compiler code made
(a checkout changed since: `stale_code`), is compiled again in place.
"""

from __future__ import annotations

import logging

from llmc.compiler.artifact import package_version, stale_code
from llmc.compiler.driver import compile_model
from llmc.kernels.native import cache_root
from llmc.models.embedded import EMBEDDED_NAME
from llmc.runtime.artifact import Artifact, ArtifactError, load_artifact


def default_artifact() -> Artifact:
    """Load the cached compile of the embedded default, compiling it first when needed."""
    path = cache_root() / "artifacts" / f"llmc-{package_version('llmc')}" / EMBEDDED_NAME.lower()
    log = logging.getLogger("llmc")
    if (path / "manifest.json").is_file():
        try:
            artifact = load_artifact(path)
            stale = stale_code(artifact.manifest)
            if stale is None:
                return artifact
            log.info("the cached default artifact is out of date (%s); compiling it again", stale)
        except ArtifactError as exc:
            log.info("the cached default artifact is unusable (%s); compiling it again", exc)
    else:
        log.info("compiling the embedded %s once into %s", EMBEDDED_NAME, path)
    compile_model(None, path)
    return load_artifact(path)
