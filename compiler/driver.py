"""`llmc compile`: load a model, trace both entry graphs, run the pipeline, write the artifact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmc.compiler.dtypes import USER_DTYPES, to_torch
from llmc.compiler.frontend import ENTRIES, trace
from llmc.models.config import ModelError
from llmc.models.loader import load_model
from llmc.passes.pipeline import check_pass_options, run_pipeline
from llmc.passes.rewrite import PassContext

from .artifact import write_artifact

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CompileConfig:
    """Options of one compile; validated on construction."""

    dtype: str = "float32"
    disabled_passes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in USER_DTYPES:
            raise ModelError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(USER_DTYPES)}")
        check_pass_options(self.disabled_passes)


def compile_model(source: str | Path | None, out: str | Path, config: CompileConfig = CompileConfig(),
                  progress: Progress = lambda stage: None) -> Path:
    """Compile `source` (HF folder, .gguf, or None for the embedded default) into `out`."""
    progress("loading model")
    model = load_model(source)
    ir_dtype = USER_DTYPES[config.dtype]
    graphs, records = {}, []
    for entry in ENTRIES:
        progress(f"tracing {entry}")
        traced = trace(model.config, entry, ir_dtype)
        progress(f"running passes on {entry}")
        graphs[entry], entry_records = run_pipeline(traced, PassContext(), config.disabled_passes)
        records += entry_records
    progress("writing artifact")
    report = {"passes": [dataclasses.asdict(r) for r in records],
              "op_counts": {entry: g.op_counts() for entry, g in graphs.items()}}
    compile_info = {"dtype": config.dtype, "passes": [r.name for r in records if r.graph == "prefill"],
                    "disabled_passes": list(config.disabled_passes)}
    return write_artifact(Path(out), model, graphs, to_torch(ir_dtype), compile_info, report)
