"""Speculative decoding end to end on tiny random models: with every draft source the engine emits
token for token what it emits without speculation (greedy, and seeded sampling with penalties,
top-k / top-p, logprobs and stop strings), across preemption and prefix-cache hits, on the native
step plans and the torch reference; the KV blocks all come back; bad configurations are one sentence.

Drafts are forced (adaptive K off, K fixed) so that every decode step verifies drafts: random
weights reject most of them, which exercises rollback on nearly every step; a draft model that is
the target itself accepts all of them (the all-accepted path and the bonus token)."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.speculative.drafters import NgramDrafter
from llmc.runtime.speculative.ngram import NgramProposer
from llmc.runtime.speculative.speculator import SpeculativeConfig
from tiny_models import build_hf_model, write_hf_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL_CACHE = 2**20
FAMILIES = ["llama_gqa", "llama_tied", "mistral", "qwen3", "gemma2", "phi3", "olmo2"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = [
    SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, seed=8, top_k=20, top_p=0.9, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, seed=9, min_p=0.05, presence_penalty=0.4, stop=("e",)),
]


def prompts(seed: int = 0) -> list[list[int]]:
    """Byte-token prompts with repeats (n-gram lookup finds matches) and a random one."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 259, (5,), generator=g).tolist()
    return [motif * 3, motif[:3] * 4 + [7], torch.randint(3, 259, (19,), generator=g).tolist()]


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """family -> an artifact compiled with a self-speculative draft graph (1 of 2 layers skipped)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"{family}-draft")
            folder = write_hf_folder(build_hf_model(family), root / "hf")
            cache[family] = compile_model(folder, root / "artifact", CompileConfig(draft_skip=1))
        return cache[family]

    return get


def engine(artifact, source: str | None, kv: int = SMALL_CACHE, k: int = 3, **options) -> Engine:
    spec = SpeculativeConfig(source, k, adaptive=False) if source else None
    e = Engine(artifact, EngineConfig(kv_cache_bytes=kv, speculative=spec, **options))
    if source == "ngram":               # single-token matches too, so random outputs still get drafts
        e.speculator.drafter = NgramDrafter(NgramProposer(max_n=3, min_n=1))
    return e


def run(e: Engine, params, prompt_list=None) -> list:
    outs = e.generate(prompt_list or prompts(), params)
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]


def assert_blocks_back(e: Engine) -> None:
    assert e.blocks.num_free_blocks == e.blocks.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_is_plain_greedy(tiny_family, family):
    artifact = tiny_family(family)[2]
    want = run(engine(artifact, None), GREEDY)
    spec = engine(artifact, "ngram")
    assert run(spec, GREEDY) == want
    stats = spec.stats().speculation
    assert stats.drafted > 0 and stats.verified_seqs > 0
    assert_blocks_back(spec)


@pytest.mark.parametrize("family", ["llama_gqa", "gemma2", "olmo2", "phi3"])
def test_self_speculative_greedy_is_plain_greedy(drafted, family):
    artifact = drafted(family)
    want = run(engine(artifact, None), GREEDY)
    spec = engine(artifact, "self")
    assert run(spec, GREEDY) == want
    assert spec.stats().speculation.drafted > 0
    assert_blocks_back(spec)


def test_a_draft_model_that_is_the_target_is_always_accepted(tiny_family):
    artifact = tiny_family("llama_gqa")[2]
    want = run(engine(artifact, None), GREEDY)
    spec = engine(artifact, f"draft:{artifact}")
    assert run(spec, GREEDY) == want
    stats = spec.stats().speculation
    assert stats.accepted == stats.drafted > 0 and stats.mean_accepted_length > 3.5     # K=3: 4 a step, less at the end
    assert_blocks_back(spec)
    assert spec.speculator.drafter.blocks.num_free_blocks == spec.blocks.num_blocks    # the draft's own cache


def test_another_draft_model_changes_nothing(tiny_family):
    target, draft = tiny_family("llama_gqa")[2], tiny_family("llama_tied")[2]
    want = run(engine(target, None), GREEDY)
    assert run(engine(target, f"draft:{draft}"), GREEDY) == want


@pytest.mark.parametrize("index", range(len(SAMPLED)))
@pytest.mark.parametrize("source", ["ngram", "self", "target"])
def test_sampling_modes_give_what_they_give_without_speculation(drafted, index, source):
    """"target": the target drafts for itself (its raw argmax), so most drafts are accepted and rows
    past the first decide: each must see the drafts before it as output (penalties)."""
    artifact, params = drafted("llama_gqa"), SAMPLED[index]
    source = f"draft:{artifact}" if source == "target" else source
    outs_plain = engine(artifact, None).generate(prompts(), params)
    outs_spec = engine(artifact, source).generate(prompts(), params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs_spec] == \
        [(o.token_ids, o.text, o.finish_reason) for o in outs_plain]


def test_logprobs_with_speculation_equal_those_without(drafted):
    artifact = drafted("llama_gqa")
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    ids = prompts()[0]
    plain = [out.logprobs for out in engine(artifact, None).stream(ids, params)]
    spec = [out.logprobs for out in engine(artifact, "self").stream(ids, params)]
    flat = lambda outs: [(r.token_id, r.logprob, r.top_logprobs) for batch in outs for r in batch]  # noqa: E731
    got, want = flat(spec), flat(plain)
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    for (_, lp, top), (_, lp_want, top_want) in zip(got, want):
        assert lp == pytest.approx(lp_want, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in top_want]


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_preemption_and_prefix_hits_change_nothing(drafted, kernels):
    """A cache of a few blocks forces preemption; the same prompts twice hit the prefix cache."""
    artifact = drafted("llama_gqa")
    many = prompts(1) + prompts(2) + prompts(1)
    want = run(engine(artifact, None, backend_options={"kernels": kernels}), GREEDY, many)
    for source in ("self", "ngram"):
        e = engine(artifact, source, kv=SMALL_CACHE // 24, backend_options={"kernels": kernels})
        assert run(e, GREEDY, many) == want
        assert e.stats().preemptions > 0 and e.blocks.prefix_hits > 0
        assert_blocks_back(e)


@pytest.mark.parametrize("source", ["self", "target"])
def test_tables_and_hashes_hold_only_accepted_tokens(drafted, source):
    """After every step a decoding sequence's table holds exactly its computed tokens' blocks, and
    the prefix cache ends with the same block hashes as without speculation."""
    artifact = drafted("llama_gqa")
    plain, spec = engine(artifact, None), engine(artifact, f"draft:{artifact}" if source == "target" else source)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for e in (plain, spec):
        for ids in prompts():
            e.add_request(ids, long)
        while e.has_unfinished():
            e.step()
            for seq in e.scheduler.running:
                if seq.is_decoding:
                    assert len(e.blocks.block_table(seq.seq_id)) == e.blocks.blocks_needed(seq.num_computed)
    stats = spec.stats().speculation
    assert stats.accepted > 0 and (source == "target" or stats.drafted > stats.accepted)     # rejections too
    assert set(spec.blocks._cached) == set(plain.blocks._cached)


CONSTRAINTS = [("regex", "[a-c]{4}-[0-9]{3}( [a-c]{2})*"), ("json_schema", '{"type": "array", "items": '
               '{"enum": ["ab", "abc", "bca"]}, "minItems": 3, "maxItems": 6}')]


@pytest.mark.parametrize("source", ["ngram", "self", "target"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_requests_speculate_and_stay_in_their_grammar(drafted, source, temperature):
    """Each verify row masked by the grammar after the drafts before it: the same tokens as without
    speculation (greedy, and seeded sampling), beside free requests, every output inside its grammar."""
    from llmc.runtime.grammar import GrammarSpec

    artifact = drafted("llama_gqa")
    source = f"draft:{artifact}" if source == "target" else source
    constrained = [SamplingParams(max_tokens=30, temperature=temperature, seed=s, grammar=GrammarSpec(kind, text))
                   for s, (kind, text) in enumerate(CONSTRAINTS * 2)]
    params = [GREEDY] * 3 + constrained
    batch = prompts() + prompts()[:1] * len(constrained)
    want = engine(artifact, None).generate(batch, params)
    spec = engine(artifact, source)
    got = spec.generate(batch, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert sum(out.metrics.drafted_tokens for out in got[3:]) > 0 and spec.stats().grammar_rows > 0
    for out, p in zip(got[3:], constrained):
        fresh = spec.grammars.matcher(p.grammar)
        assert fresh.matcher.validate_tokens(out.token_ids) == len(out.token_ids)
    assert_blocks_back(spec)


def test_bad_speculative_configurations_are_one_sentence(tiny_family, tmp_path):
    plain = tiny_family("llama_gqa")[2]
    with pytest.raises(RequestError, match="num_draft_tokens=0 must be in 1..16"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(RequestError, match="speculative source 'medusa' is unknown"):
        SpeculativeConfig("medusa")
    with pytest.raises(RequestError, match="has no draft graph; compile it with --draft-skip N"):
        Engine(plain, EngineConfig(kv_cache_bytes=SMALL_CACHE, speculative=SpeculativeConfig("self")))
    other = compile_model(write_hf_folder(build_hf_model("llama_gqa", vocab_size=320), tmp_path / "hf"),
                          tmp_path / "artifact")
    with pytest.raises(RequestError, match="its vocabulary has 320 tokens, the target's 300"):
        Engine(plain, EngineConfig(kv_cache_bytes=SMALL_CACHE, speculative=SpeculativeConfig(f"draft:{other}")))
