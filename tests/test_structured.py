"""Structured output on tiny random models (runtime/grammar.py, the engine's grammar masks): a bad
constraint is one RequestError line naming its field; a grammar is built once per text and every
request gets its own matcher; sampling at temperature 1, in every sampling mode and for many seeds,
never leaves the grammar (checked by a fresh llguidance matcher, not the engine's); free requests
batched with constrained ones keep their greedy tokens; a complete grammar ends a request ("stop")
before EOS, max_tokens still cuts it ("length"), and a preempted request keeps its grammar's state.

The tiny models' byte tokenizer (ids 3..258 are the bytes) makes every output spell its text one
byte a token, so the grammar is exercised at every byte, multi-byte characters included."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance
import pytest
import torch

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.grammar import GrammarCompiler, GrammarSpec
from llmc.runtime.sampling_params import RequestError, SamplingParams
from test_bad_inputs import assert_process_error, run_llmc
from tiny_models import byte_tokenizer

SMALL_CACHE = EngineConfig(kv_cache_bytes=2**20)  # ~100 blocks of 16 tokens for the tiny models
VOCAB, EOS = 300, 2
SEEDS = range(32)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n", "tags"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": -5, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}}}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'
SPECS = [GrammarSpec.json_schema(SCHEMA, "response_format.json_schema.schema"),
         GrammarSpec("regex", REGEX, "structured_outputs.regex"),
         GrammarSpec.choice(CHOICES, "structured_outputs.choice"),
         GrammarSpec("grammar", LARK, "structured_outputs.grammar")]
ENDLESS = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}}, "response_format")


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return byte_tokenizer().to_str()


@pytest.fixture(scope="module")
def fresh(tokenizer_json):
    """spec -> a new llguidance matcher of our own, sharing nothing with any engine's."""
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=[EOS])
    return lambda spec: llguidance.LLMatcher(tokenizer, spec.llguidance_grammar(), log_level=0)


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_gqa")[2]


@dataclass
class Run:
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list


def run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Run]:
    """Every request to its end through engine.step (the outputs' deltas joined), in prompt order."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    runs = {i: Run([], "", "", []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            run = runs[out.request_id]
            run.token_ids += out.new_token_ids
            run.text += out.new_text
            run.logprobs += out.logprobs
            run.finish_reason = out.finish_reason or ""
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [runs[i] for i in ids]


def byte_prompts(n: int, seed: int, length: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (length,), generator=g).tolist() for _ in range(n)]


# ------------------------------------------------------------------------ what the output must be


def meets(spec: GrammarSpec, text: str) -> bool:
    """The constraint read as its user means it (not through llguidance)."""
    if spec == ENDLESS:
        return all(type(v) is int for v in json.loads(text))
    if spec.kind == "json_schema":
        value = json.loads(text)
        return (set(value) == {"color", "n", "tags"} and value["color"] in ("red", "green", "blue")
                and type(value["n"]) is int and -5 <= value["n"] <= 99 and len(value["tags"]) <= 2
                and all(isinstance(t, str) and len(t) <= 4 for t in value["tags"]))
    if spec.kind == "choice":
        return text in CHOICES
    pattern = REGEX if spec.kind == "regex" else r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"
    return re.fullmatch(pattern, text, flags=re.ASCII) is not None


def assert_inside(fresh, spec: GrammarSpec, run: Run) -> None:
    """Every token was allowed, a finished ("stop") output is complete and meets the constraint."""
    matcher = fresh(spec)
    assert matcher.validate_tokens(run.token_ids) == len(run.token_ids), (spec.kind, run.text)
    assert run.finish_reason in ("stop", "length"), run
    if run.finish_reason == "stop":
        assert matcher.consume_tokens(run.token_ids) and matcher.is_accepting(), (spec.kind, run.text)
        assert meets(spec, run.text), (spec.kind, run.text)


def assert_top_logprobs_allowed(fresh, spec: GrammarSpec, run: Run) -> None:
    """Logprobs list only tokens the grammar allowed at that step, the chosen one finite."""
    matcher = fresh(spec)
    assert len(run.logprobs) == len(run.token_ids)
    for token, result in zip(run.token_ids, run.logprobs):
        assert result.token_id == token and result.logprob > float("-inf")
        assert all(matcher.validate_tokens([t]) == 1 for t, _ in result.top_logprobs)
        assert matcher.consume_token(token)


# ---------------------------------------------------------------------- compiler and bad input


BAD = [
    (lambda: GrammarSpec.json_schema({"type": "frobnicate"}, "response_format.json_schema.schema"),
     "response_format.json_schema.schema", "frobnicate"),
    (lambda: GrammarSpec.json_schema({"type": "object", "not": {"type": "string"}}, "structured_outputs.json"),
     "structured_outputs.json", "not"),
    (lambda: GrammarSpec.json_schema("an object", "structured_outputs.json"), "structured_outputs.json", "schema"),
    (lambda: GrammarSpec("regex", "a(b", "structured_outputs.regex"), "structured_outputs.regex", "regex"),
    (lambda: GrammarSpec("grammar", "start: foo", "structured_outputs.grammar"), "structured_outputs.grammar", "foo"),
    (lambda: GrammarSpec.choice([], "structured_outputs.choice"), "structured_outputs.choice", "non-empty"),
    (lambda: GrammarSpec("xml", "<a/>"), "structured_outputs", "xml"),
]


@pytest.mark.parametrize("make, param, word", BAD, ids=["schema", "not", "not-a-schema", "regex", "lark", "choice",
                                                        "kind"])
def test_a_bad_constraint_is_one_line_naming_its_field(tokenizer_json, make, param, word):
    compiler = GrammarCompiler(tokenizer_json, VOCAB, (EOS,))
    with pytest.raises(RequestError) as caught:
        compiler.matcher(make())
    assert caught.value.param == param and word in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value) and str(caught.value)


def test_each_distinct_grammar_is_built_once(tokenizer_json, monkeypatch):
    compiler = GrammarCompiler(tokenizer_json, VOCAB, (EOS,), cache_size=2)
    built = []
    build = compiler._build
    monkeypatch.setattr(compiler, "_build", lambda spec: built.append(spec) or build(spec))
    schema, regex, choice = SPECS[0], SPECS[1], SPECS[2]
    for spec in (schema, GrammarSpec.json_schema(dict(SCHEMA), schema.param), schema, regex, regex):
        compiler.matcher(spec)
    assert built == [schema, regex]              # the same schema sent again (a new dict) is the same text
    compiler.matcher(choice)                     # a third: the least recently used (the schema) goes
    compiler.matcher(regex)
    compiler.matcher(schema)
    assert built == [schema, regex, choice, schema]


def test_each_request_gets_its_own_matcher_state(tokenizer_json, fresh):
    compiler = GrammarCompiler(tokenizer_json, VOCAB, (EOS,))
    spec = SPECS[0]
    first, second = compiler.matcher(spec), compiler.matcher(spec)
    assert first.matcher is not second.matcher
    for token in byte_tokenizer().encode('{"color": "r').ids:
        assert first.accept(token)
    start = compiler.next_token_bitmasks([compiler.matcher(spec)])
    assert torch.equal(compiler.next_token_bitmasks([second]), start)     # untouched by the first's tokens
    assert not torch.equal(compiler.next_token_bitmasks([first]), start)
    both = compiler.next_token_bitmasks([first, second])                  # several rows at once, same masks
    assert torch.equal(both[1:], start) and torch.equal(both[:1], compiler.next_token_bitmasks([first]))


def test_masks_along_drafts_follow_the_grammar_and_leave_it_as_it_was(tokenizer_json):
    """Row i: what is allowed after drafts[:i] (as a matcher that consumed them says); rows past a
    refused draft or past the grammar's end allow everything; the matcher's state is unchanged."""
    compiler = GrammarCompiler(tokenizer_json, VOCAB, (EOS,))
    spec = GrammarSpec("regex", "ab[0-9]{2}")
    ids = byte_tokenizer().encode("ab1").ids
    matcher = compiler.matcher(spec)
    masks = matcher.bitmasks_along(ids + [ord("x") + 3, ids[0]], (VOCAB + 31) // 32)
    step = compiler.matcher(spec)
    for i, token in enumerate(ids):
        assert torch.equal(masks[i], compiler.next_token_bitmasks([step])[0]), i
        assert step.accept(token)
    assert torch.equal(masks[3], compiler.next_token_bitmasks([step])[0])       # the refused draft's row
    assert torch.equal(masks[4], torch.full_like(masks[4], -1))                 # past it: anything
    start = compiler.next_token_bitmasks([compiler.matcher(spec)])[0]
    assert torch.equal(compiler.next_token_bitmasks([matcher])[0], start)        # state as it was
    done = matcher.bitmasks_along(byte_tokenizer().encode("ab12").ids + [5], (VOCAB + 31) // 32)
    assert torch.equal(done[4], torch.full_like(done[4], -1)) and not matcher.is_finished   # past the end


# ------------------------------------------------------------------------------------ sampling


MODES = {"plain": {}, "top_k": {"top_k": 5}, "top_p": {"top_p": 0.8}, "min_p": {"min_p": 0.05},
         "repetition": {"repetition_penalty": 1.3}, "frequency": {"frequency_penalty": 1.5},
         "presence": {"presence_penalty": -1.5}, "logprobs": {"logprobs": 3}}


@pytest.mark.parametrize("mode", list(MODES))
def test_sampling_never_leaves_the_grammar(artifact, fresh, mode):
    specs = [SPECS[seed % len(SPECS)] for seed in SEEDS]
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, grammar=spec, **MODES[mode])
              for seed, spec in zip(SEEDS, specs)]
    engine = Engine(artifact, SMALL_CACHE)
    runs = run_all(engine, byte_prompts(len(params), seed=len(mode)), params)
    for spec, run in zip(specs, runs):
        assert_inside(fresh, spec, run)
        if mode == "logprobs":
            assert_top_logprobs_allowed(fresh, spec, run)
    finished = {spec.kind for spec, run in zip(specs, runs) if run.finish_reason == "stop"}
    assert finished == {spec.kind for spec in SPECS}     # every kind of grammar was seen to its end
    assert len({tuple(run.token_ids) for run in runs}) > len(runs) // 2   # the seeds sampled differently
    assert engine.stats().grammar_rows == sum(len(run.token_ids) for run in runs)


# ------------------------------------------------------------------------ batching and ending


def test_free_requests_batched_with_constrained_ones_keep_their_greedy_tokens(artifact):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = byte_prompts(3, seed=1, length=7)
    alone = [run_all(Engine(artifact, SMALL_CACHE), [p], [free])[0].token_ids for p in prompts]
    constrained = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, grammar=SPECS[s % 4]) for s in range(4)]
    engine = Engine(artifact, SMALL_CACHE)
    together = run_all(engine, [prompts[0], *byte_prompts(2, seed=2), prompts[1], *byte_prompts(2, seed=3),
                                prompts[2]], [free, *constrained[:2], free, *constrained[2:], free])
    assert [together[i].token_ids for i in (0, 3, 6)] == alone
    assert engine.stats().grammar_rows > 0


def test_a_complete_grammar_ends_the_request_before_eos(artifact, fresh):
    engine = Engine(artifact, SMALL_CACHE)
    prompts = byte_prompts(2, seed=4)
    choice = GrammarSpec.choice(["yes", "no"], "structured_outputs.choice")
    runs = run_all(engine, prompts, [SamplingParams(max_tokens=40, temperature=0.0, grammar=choice),
                                     SamplingParams(max_tokens=40, temperature=0.0, grammar=SPECS[0])])
    for spec, run in zip((choice, SPECS[0]), runs):
        assert run.finish_reason == "stop" and EOS not in run.token_ids
        assert len(run.token_ids) == len(run.text.encode())          # every token a byte of the text
        assert_inside(fresh, spec, run)
    assert runs[0].text in ("yes", "no")
    free = run_all(engine, prompts[:1], [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)])[0]
    assert len(free.token_ids) == 40                                  # unconstrained, it would go on


def test_max_tokens_cuts_a_constrained_request(artifact, fresh):
    run = run_all(Engine(artifact, SMALL_CACHE), byte_prompts(1, seed=5),
                  [SamplingParams(max_tokens=6, temperature=0.0, grammar=SPECS[0])])[0]
    assert run.finish_reason == "length" and len(run.token_ids) == 6
    assert_inside(fresh, SPECS[0], run)
    matcher = fresh(SPECS[0])
    assert matcher.consume_tokens(run.token_ids) and not matcher.is_accepting()


def test_a_preempted_constrained_request_stays_in_its_grammar(artifact, fresh):
    engine = Engine(artifact, EngineConfig(kv_cache_bytes=2**17, max_num_seqs=16))   # 14 blocks of 16 tokens
    specs = [ENDLESS if seed % 2 else SPECS[seed // 2 % 4] for seed in range(16)]   # half run to max_tokens
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed, grammar=spec)
              for seed, spec in enumerate(specs)]
    runs = run_all(engine, byte_prompts(16, seed=6, length=20), params)
    assert engine.stats().preemptions > 0
    for spec, run in zip(specs, runs):
        assert_inside(fresh, spec, run)


# ------------------------------------------------------------------------------ the benchmark


def test_bench_structured_measures_both_sides_on_the_same_work(artifact, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_llmc("bench-structured", artifact, "--batch", "1,3", "--output-len", 6, "--repeats", 1,
                    "--kv-memory", "1MiB", "--threads", 1, "--json", out)
    assert proc.returncode == 0, proc.stderr
    for column in ("batch", "free tok/s", "constrained tok/s", "ratio", "mask us/row", "mask share"):
        assert column in proc.stdout
    result = json.loads(out.read_text())
    assert result["schema"]["minItems"] == 6 and [r["free"]["batch"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        free, constrained = run["free"], run["constrained"]
        assert free["tokens"] == constrained["tokens"] == 6 * free["batch"]      # neither side ended early
        assert free["mask_rows"] == 0 and constrained["mask_rows"] == constrained["decode_tokens"] > 0
    assert_process_error(run_llmc("bench-structured", artifact, "--batch", "1,x"), "--batch", "1,64")
