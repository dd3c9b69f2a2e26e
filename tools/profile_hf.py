"""transformers as the peer of `llmc profile --baseline hf`: the same batch-1 decode and prefill,
same model, same dtype, same machine, in the same run.

decode: `generate` greedily from a 16-token prompt, `tokens` new tokens, minus the prefill of
those 16 tokens (timed apart), per token. prefill: one forward over `prompt_len` tokens (the
first call warms up; the best of two timed calls counts), logits at the last position only, as
llmc's prefill computes them.
"""

from __future__ import annotations

import time

import torch

from llmc.runtime.artifact import Artifact

from .bench_hf import load_hf_model
from .profile_steps import PROMPT_FOR_DECODE, best_of


def _prompt(vocab: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g)


def _forward_seconds(model, ids: torch.Tensor) -> float:
    return best_of(lambda: model(ids, logits_to_keep=1), 2)


@torch.inference_mode()
def hf_profile(artifact: Artifact, hf_model: str | None, decode_tokens: int, prompt_len: int) -> dict:
    """transformers' batch-1 seconds per decoded token and seconds for a prefill of prompt_len."""
    model = load_hf_model(artifact, hf_model, device="cpu")
    vocab = artifact.config.vocab_size
    prompt = _prompt(vocab, PROMPT_FOR_DECODE, 0)
    short_prefill = _forward_seconds(model, prompt)
    model.generate(prompt, max_new_tokens=2, do_sample=False)            # warm-up
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
    decode = (time.perf_counter() - start - short_prefill) / decode_tokens
    return {"decode_s": decode, "prefill_s": _forward_seconds(model, _prompt(vocab, prompt_len, 1))}
