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
dtype as llmc does, so a float32 ratio can be read against either.
"""

from __future__ import annotations

import torch

from llmc.runtime.artifact import Artifact
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams

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


def _prefill_seconds(model, ids: torch.Tensor, path: HfPath) -> float:
    return best_of(lambda: path.forward(model, ids, logits_to_keep=1), PREFILL_REPEATS)


def hf_profile(artifact: Artifact, hf_model: str | None, decode_tokens: int, prompt_len: int,
               decode_context: int = PROMPT_FOR_DECODE, compile: bool = True) -> dict:
    """transformers' batch-1 seconds per output token after a `decode_context`-token prompt and seconds
    for a prefill of prompt_len, each on its fastest path, with every path tried."""
    model = load_hf_model(artifact, hf_model, device="cpu")
    vocab = artifact.config.vocab_size
    prompt = decode_prompt(vocab, decode_context)
    decode_path, decode_tries = tune(model.dtype, [1], lambda p: _decode_seconds(model, prompt, decode_tokens, p),
                                     compile=compile)
    ids = torch.tensor([decode_prompt(vocab, prompt_len, seed=1)])
    prefill_paths = [HfPath(batch_size=1), HfPath(batch_size=1, attn="eager")]
    prefill_paths += [HfPath(batch_size=1, autocast=True)] * (model.dtype == torch.float32)
    seconds = {p: _prefill_seconds(model, ids, p) for p in prefill_paths}
    prefill = {p.label: s for p, s in seconds.items()}
    own_dtype = {p.label: s for p, s in seconds.items() if not p.autocast}       # the model's arithmetic, as llmc's
    decode_s = min(t["seconds"] for t in decode_tries if "seconds" in t)
    return {"decode_s": decode_s, "decode_path": decode_path.label, "decode_tried": decode_tries,
            "prefill_s": min(prefill.values()), "prefill_path": min(prefill, key=prefill.get), "prefill_tried": prefill,
            "prefill_own_dtype_s": min(own_dtype.values()), "prefill_own_dtype_path": min(own_dtype, key=own_dtype.get)}
