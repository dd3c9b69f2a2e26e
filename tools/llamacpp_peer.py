"""The llama.cpp side of tools/bench_llamacpp.py, run as a child in an interpreter that has
llama-cpp-python (often its own venv: llmc is not importable there, so this file imports only the
standard library and `llama_cpp`).

    python llamacpp_peer.py probe
        prints {"version": V} or, when llama_cpp cannot be imported, {"missing": WHY}
    python llamacpp_peer.py decode GGUF THREADS TOKENS PROMPT_IDS_JSON REPEATS
        loads GGUF with n_threads = n_threads_batch = THREADS, decodes 2 tokens untimed (the weights'
        pages mapped, its buffers made), then REPEATS times from an empty cache: greedy decode (top_k
        1) of TOKENS tokens after the prompt ids, timed as llmc's batch-1 decode is: from the first
        token out to the last, over the tokens after the first; and the prompt, from the call to the
        first token out; prints {"version", "runs": [{"decode_s": seconds, "tokens": TOKENS - 1,
        "token_ids": [...], "prefill_s": seconds}, ...]}

Every answer is one JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
import time


def probe() -> dict:
    try:
        import llama_cpp
    except Exception as exc:                # an ImportError, or a build that fails to load its library
        return {"missing": f"{type(exc).__name__}: {exc}"}
    return {"version": getattr(llama_cpp, "__version__", "unknown")}


def decode(gguf: str, threads: int, tokens: int, prompt_ids: list[int], repeats: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(prompt_ids) + tokens + 8, n_batch=max(len(prompt_ids), 8), verbose=False)
    greedy(llm, prompt_ids, 2)
    runs = [greedy(llm, prompt_ids, tokens) for _ in range(repeats)]
    return {"version": llama_cpp.__version__, "runs": runs}


def greedy(llm, prompt_ids: list[int], tokens: int) -> dict:
    """One timed greedy decode of `tokens` tokens after the prompt, from an empty cache (reset: else
    generate would keep the prompt's cached prefix and skip its processing)."""
    llm.reset()
    out, first, start = [], None, time.perf_counter()
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
        now = time.perf_counter()
        first = first or now
        out.append(token)
        if len(out) == tokens:
            break
    return {"decode_s": now - first, "tokens": len(out) - 1, "token_ids": out, "prefill_s": first - start}


def main(argv: list[str]) -> None:
    if argv[:1] == ["probe"]:
        print(json.dumps(probe()))
        return
    _, gguf, threads, tokens, prompt, repeats = argv
    print(json.dumps(decode(gguf, int(threads), int(tokens), json.loads(prompt), int(repeats))))


if __name__ == "__main__":
    main(sys.argv[1:])
