"""transformers as the peer of `llmc profile --baseline hf`: the same batch-1 decode and prefill,
same model, same dtype, same machine, in the same run, timed at the same boundaries as llmc.

decode: each side generates greedily from the same 16-token prompt, EOS ignored, and its time per
output token runs from the first token out to the last (llmc: `served_decode`, streamed through
the engine loop's thread as `llmc generate` streams; transformers: `generate`'s streamer, its own
greedy pick inside), so neither side's prefill nor its set-up is in the figure. transformers runs
every path a user would try for batch 1 (hf_paths: sdpa or eager, the static cache, torch.compile
over it where asked, bf16 autocast for float32), and the fastest counts. prefill: one forward over `prompt_len`
tokens with the logits of the last position only, as llmc's prefill computes them, with sdpa or
eager (and bf16 autocast for float32): the best of two timed calls after a warm-up, fastest path;
and the fastest path without autocast too (`prefill_own_dtype_s`), which computes in the model's
dtype as llmc does, so a float32 ratio can be read against either. llmc's prefill of the same
prompt is timed right after each of those calls (`llmc_prefill`), and the ratios take the fastest
of those: a neighbour's load that comes and goes meets both sides alike.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from llmc.runtime.artifact import Artifact
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_inputs import build_step_inputs

from .bench_hf import load_hf_model
from .hf_paths import HfPath, TokenClock, tune
from .profile_steps import PREFILL_REPEATS, PROMPT_FOR_DECODE, best_of


def decode_prompt(vocab: int, length: int = PROMPT_FOR_DECODE, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def served_decode(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, dict[str, float]]:
    """llmc's batch-1 seconds per output token as a user gets them: one request streamed by
    `engine.stream` (`llmc generate`'s path: an engine loop's thread runs the scheduler, the steps,
    the sampler and the detokenizer, and hands each output to this thread), first token out to last;
    and the engine's phases per step of that request (HostTimes.per_step). A request of one token goes
    first, so the prompt is in the prefix cache where the engine has one and the measured request's
    steps are decodes, not a long prompt's prefill among them."""
    for _ in engine.stream(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        pass
    clock, before = TokenClock(), engine.host_times.snapshot()
    clock.put(prompt)
    for out in engine.stream(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)):
        if out.new_token_ids:
            clock.put(out.new_token_ids)
    return clock.seconds_per_token(), engine.host_times.since(before).per_step()


def _decode_seconds(model, prompt: list[int], tokens: int, path: HfPath) -> float:
    ids = torch.tensor([prompt])
    path.generate(model, ids, max_new_tokens=2, do_sample=False)       # warm-up (and compile, on that path)
    clock = TokenClock()
    path.generate(model, ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False, streamer=clock)
    return clock.seconds_per_token()


def llmc_prefill(engine: Engine, tokens: int, seed: int = 1) -> Callable[[], float]:
    """A timer for hf_profile's `beside`: each call one untimed llmc prefill step over `tokens` random
    tokens (profile_prefill's prompt), from building its inputs to the logits; its seconds."""
    ids = decode_prompt(engine.artifact.config.vocab_size, tokens, seed)

    def run() -> float:
        seq = Sequence(1, ids, SamplingParams(max_tokens=1))
        engine.blocks.allocate(seq.seq_id, seq.prompt_ids)
        start = time.perf_counter()
        engine.runner.run_step("prefill", build_step_inputs([Chunk(seq, 0, seq.num_tokens)], engine.blocks))
        seconds = time.perf_counter() - start
        engine.blocks.free(seq.seq_id)
        return seconds
    return run


def _prefill_seconds(model, ids: torch.Tensor, path: HfPath, beside: Callable[[], float] | None,
                     beside_runs: list[float]) -> float:
    """transformers' best prefill on `path`; with `beside`, llmc's prefill timed after each of its runs
    into `beside_runs`, so that the two sides meet the same neighbours' load."""
    between = (lambda: beside_runs.append(beside())) if beside else None
    return best_of(lambda: path.forward(model, ids, logits_to_keep=1), PREFILL_REPEATS, between)


def hf_profile(artifact: Artifact, hf_model: str | None, decode_tokens: int, prompt_len: int,
               decode_context: int = PROMPT_FOR_DECODE, compile: bool = True,
               beside: Callable[[], float] | None = None) -> dict:
    """transformers' batch-1 seconds per output token after a `decode_context`-token prompt and seconds
    for a prefill of prompt_len, each on its fastest path, with every path tried; with `beside`
    (llmc_prefill), also the fastest of llmc's prefills timed between transformers' (`llmc_prefill_s`)."""
    model = load_hf_model(artifact, hf_model, device="cpu")
    vocab = artifact.config.vocab_size
    prompt = decode_prompt(vocab, decode_context)
    decode_path, decode_tries = tune(model.dtype, [1], lambda p: _decode_seconds(model, prompt, decode_tokens, p),
                                     compile=compile)
    ids = torch.tensor([decode_prompt(vocab, prompt_len, seed=1)])
    prefill_paths = [HfPath(batch_size=1), HfPath(batch_size=1, attn="eager")]
    prefill_paths += [HfPath(batch_size=1, autocast=True)] * (model.dtype == torch.float32)
    beside_runs: list[float] = []
    seconds = {p: _prefill_seconds(model, ids, p, beside, beside_runs) for p in prefill_paths}
    prefill = {p.label: s for p, s in seconds.items()}
    own_dtype = {p.label: s for p, s in seconds.items() if not p.autocast}       # the model's arithmetic, as llmc's
    decode_s = min(t["seconds"] for t in decode_tries if "seconds" in t)
    return {"decode_s": decode_s, "decode_path": decode_path.label, "decode_tried": decode_tries,
            "prefill_s": min(prefill.values()), "prefill_path": min(prefill, key=prefill.get), "prefill_tried": prefill,
            "prefill_own_dtype_s": min(own_dtype.values()), "prefill_own_dtype_path": min(own_dtype, key=own_dtype.get),
            "llmc_prefill_s": min(beside_runs, default=None), "llmc_prefill_runs": len(beside_runs)}


def baseline_lines(r: dict) -> list[str]:
    """The profile's lines on transformers (result `r` with an "hf" entry), or none."""
    if "hf" not in r:
        return []
    hf, served, p = r["hf"], r["served_decode_s"], r["prefill"]
    llmc = _llmc_prefill_s(hf, p)
    return [f"transformers, same run, same boundaries: decode {1000 * hf['decode_s']:.1f} ms/token "
            f"(llmc as served {hf['decode_s'] / served:.2f}x as fast; its best of {len(hf['decode_tried'])} paths: "
            f"{hf['decode_path']}), prefill {1000 * hf['prefill_s']:.0f} ms (llmc takes {llmc / hf['prefill_s']:.2f}x "
            f"its time; its best of {len(hf['prefill_tried'])}: {hf['prefill_path']})", *_own_dtype_line(hf, p),
            *_beside_line(hf)]


def _llmc_prefill_s(hf: dict, p: dict) -> float:
    """llmc's prefill seconds for the ratios: timed between transformers' runs where it was, else the profile's."""
    return hf.get("llmc_prefill_s") or p["seconds"]


def _own_dtype_line(hf: dict, p: dict) -> list[str]:
    """transformers' fastest prefill in the model's own arithmetic, where its fastest took autocast."""
    if hf["prefill_own_dtype_path"] == hf["prefill_path"]:
        return []
    own = hf["prefill_own_dtype_s"]
    return [f"    transformers' prefill without autocast (the model's dtype, as llmc computes): {1000 * own:.0f} ms "
            f"(llmc takes {_llmc_prefill_s(hf, p) / own:.2f}x its time; {hf['prefill_own_dtype_path']})"]


def _beside_line(hf: dict) -> list[str]:
    """Which llmc prefill the ratios took: the fastest of those timed right after each of transformers'."""
    if not hf.get("llmc_prefill_s"):
        return []
    return [f"    llmc's prefill in those ratios: {1000 * hf['llmc_prefill_s']:.0f} ms, the fastest of "
            f"{hf['llmc_prefill_runs']} runs, each right after one of transformers' (the same neighbours' load)"]
