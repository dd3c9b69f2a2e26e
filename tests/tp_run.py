"""Rank 0 of a tensor-parallel test run (tests/test_tensor_parallel.py), and the same requests on one
process for the reference.

`python tests/tp_run.py ARTIFACT TP SPEC OUT` starts TP ranks (runtime/tensor_parallel: rank 0 here,
ranks 1.. as local workers), runs SPEC's requests on an engine over them and writes what
`run_requests` returns to OUT as JSON. SPEC: {"engine": EngineConfig fields, "prompts": [[ids]],
"max_tokens": n, "logprobs": k}; every request greedy, all added at once (continuous batching).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams


def run_requests(engine: Engine, spec: dict) -> dict:
    """Each request's tokens and the top logprobs of each of its tokens (prompt tokens after the first,
    then the generated ones), with the engine's counters."""
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=spec["logprobs"],
                            prompt_logprobs=spec["logprobs"], ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in spec["prompts"]]
    tokens = {rid: [] for rid in ids}
    logprobs = {rid: [] for rid in ids}
    errors = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            scored = (out.prompt_logprobs or [])[1:] + out.logprobs       # the first prompt token has none
            logprobs[out.request_id] += [[list(p) for p in r.top_logprobs] for r in scored]
            if out.error:
                errors.append(out.error)
    stats = engine.stats()
    return {"tokens": [tokens[r] for r in ids], "logprobs": [logprobs[r] for r in ids], "errors": errors,
            "preemptions": stats.preemptions, "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "steps": stats.steps, "plans": engine.runner.capabilities.plans()}


def main(artifact: str, tp: int, spec_path: str, out_path: str) -> None:
    from llmc.runtime.tensor_parallel import start_ranks

    spec = json.loads(Path(spec_path).read_text())
    ranks = start_ranks(tp, Path(artifact), timeout=30.0)
    try:
        engine = Engine(artifact, EngineConfig(**spec["engine"], ranks=ranks))
        Path(out_path).write_text(json.dumps(run_requests(engine, spec)))
    finally:
        ranks.stop()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
