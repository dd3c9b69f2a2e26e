"""Prefix-cache salts: cached KV is shared only between sequences under the same salt.

Keys are sha256 chains started from the sequence's salt (runtime/block_manager.py), so equal
tokens under different salts, or different tokens whose Python `hash` collides, never share a
block. Checked on the BlockManager alone (integers), through Engine.generate (request
`cache_salt`, engine `prefix_cache_salt`), through the server's `cache_salt` field and through
`llmc serve --prefix-cache-salt`. One tiny model, compiled once (tiny_family is per session).
"""

from __future__ import annotations

import httpx
import pytest

from llmc.runtime import block_manager
from llmc.runtime.block_manager import BlockManager, cache_salt
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server import ServerConfig

from live_server import LiveServer
from test_bad_inputs import assert_cli_error, cli

BS = 16
PROMPT = [3 + (7 * i) % 250 for i in range(4 * BS + 5)]      # byte tokens: four full blocks and a part
SMALL_CACHE = dict(kv_cache_bytes=2**20)                     # ~100 blocks of 16 tokens for the tiny model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------- BlockManager alone


def cached_after(first_salt: str | None, second_salt: str | None, tokens=PROMPT) -> tuple[int, BlockManager]:
    """Tokens the second sequence finds cached after a first one with the same tokens registered its
    full blocks, each under its own salt; and the manager, both sequences still live."""
    bm = BlockManager(32, BS)
    bm.allocate(0, tokens, first_salt)
    bm.register_full_blocks(0, tokens, len(tokens))
    return bm.allocate(1, tokens, second_salt), bm


@pytest.mark.parametrize("first, second", [("tenant-a", "tenant-b"), (None, "tenant-a"), ("tenant-a", None)])
def test_different_salts_never_share_a_block(first, second):
    cached, bm = cached_after(first, second)
    assert cached == 0
    assert not set(bm.block_table(0)) & set(bm.block_table(1))
    assert all(bm.blocks[b].ref_count == 1 for b in bm.block_table(0) + bm.block_table(1))


@pytest.mark.parametrize("salt", ["tenant-a", None])
def test_the_same_salt_shares_the_full_blocks(salt):
    cached, bm = cached_after(salt, salt)
    assert cached == 4 * BS
    assert bm.block_table(1)[:4] == bm.block_table(0)[:4]
    assert bm.block_table(1)[4] != bm.block_table(0)[4]                 # the partial block is its own


# ----------------------------------------------------------------- a forced hash collision

M61 = 2**61 - 1                  # CPython hashes ints modulo this prime: hash(M61) == hash(0)
BLOCK_A = [0] * BS
BLOCK_B = [M61] + [0] * (BS - 1)


def python_hash_key(parent, tokens) -> int:
    """The key prefix caching used before sha256 chains: Python's hash of (parent key, tokens)."""
    return hash((parent, tuple(tokens)))


def test_the_two_blocks_collide_under_pythons_hash():
    assert BLOCK_A != BLOCK_B
    assert python_hash_key(None, BLOCK_A) == python_hash_key(None, BLOCK_B)
    assert block_manager.block_key(None, BLOCK_A) != block_manager.block_key(None, BLOCK_B)


def cached_for_colliding_block() -> tuple[int, BlockManager]:
    """Tokens the sequence of BLOCK_B finds cached after the sequence of BLOCK_A registered its block."""
    bm = BlockManager(8, BS)
    bm.allocate(0, BLOCK_A + [5])
    bm.register_full_blocks(0, BLOCK_A + [5], BS + 1)
    return bm.allocate(1, BLOCK_B + [5]), bm


def test_colliding_blocks_are_not_shared():
    cached, bm = cached_for_colliding_block()
    assert cached == 0 and bm.block_table(1)[0] != bm.block_table(0)[0]


def test_a_manager_keyed_by_pythons_hash_would_share_them(monkeypatch):
    """The test above can fail: under the old key the second sequence reads the first one's KV."""
    monkeypatch.setattr(block_manager, "block_key", python_hash_key)
    cached, bm = cached_for_colliding_block()
    assert cached == BS and bm.block_table(1)[0] == bm.block_table(0)[0]


# ------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def artifact(tiny_family):
    return tiny_family("llama_hd32")[2]


def cached_tokens(engine: Engine, salt: str | None) -> int:
    """Prompt tokens PROMPT found in the prefix cache, run as a request with this cache_salt."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, cache_salt=salt)
    return engine.generate([PROMPT], params)[0].metrics.cached_prompt_tokens


@pytest.mark.parametrize("server_salt", [None, "this-server"])
def test_requests_share_cached_prompts_only_under_the_same_salt(artifact, server_salt):
    engine = Engine(artifact, EngineConfig(**SMALL_CACHE, prefix_cache_salt=server_salt))
    assert engine.blocks.block_size == BS
    assert cached_tokens(engine, "tenant-a") == 0
    assert cached_tokens(engine, "tenant-b") == 0                       # the same prompt, another salt
    assert cached_tokens(engine, None) == 0
    assert cached_tokens(engine, "tenant-a") == 4 * BS                  # the same salt again: cached
    assert cached_tokens(engine, None) == 4 * BS


def test_the_engine_salt_starts_every_key(artifact):
    """An engine's prefix_cache_salt keys its blocks apart from the unsalted keys of the same tokens."""
    engine = Engine(artifact, EngineConfig(**SMALL_CACHE, prefix_cache_salt="this-server"))
    cached_tokens(engine, None)
    assert engine.blocks.allocate(1001, PROMPT, salt=None) == 0
    assert engine.blocks.allocate(1002, PROMPT, salt=cache_salt("this-server", None)) == 4 * BS
    engine.blocks.free(1001)
    engine.blocks.free(1002)


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server(artifact):
    live = LiveServer(Engine(artifact, EngineConfig(**SMALL_CACHE)), ServerConfig(model_name="tiny"))
    yield live
    live.stop()


def hits_of(server: LiveServer, endpoint: str, body: dict) -> int:
    """Prompt blocks the request found in the prefix cache (the engine's hit counter, before and after)."""
    blocks = server.loop.engine.blocks
    before = blocks.prefix_hits
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={"max_tokens": 2, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    server.wait_idle()
    return blocks.prefix_hits - before


@pytest.mark.parametrize("endpoint, body", [
    ("completions", {"prompt": PROMPT}),
    ("chat/completions", {"messages": [{"role": "user", "content": "salted " * 12}]}),
])
def test_the_cache_salt_field_reaches_the_engine(server, endpoint, body):
    assert hits_of(server, endpoint, {**body, "cache_salt": "tenant-a"}) == 0
    assert hits_of(server, endpoint, {**body, "cache_salt": "tenant-b"}) == 0
    assert hits_of(server, endpoint, body) == 0
    assert hits_of(server, endpoint, {**body, "cache_salt": "tenant-a"}) >= 4


@pytest.mark.parametrize("salt, words", [("", "cache_salt must be 1 to 1024 characters"),
                                         ("x" * 1025, "cache_salt must be 1 to 1024 characters"),
                                         (7, "cache_salt: input should be a valid string")])
@pytest.mark.parametrize("endpoint, body", [("completions", {"prompt": "a"}),
                                            ("chat/completions", {"messages": [{"role": "user", "content": "a"}]})])
def test_a_bad_cache_salt_is_a_400_naming_it(server, endpoint, body, salt, words):
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={**body, "cache_salt": salt}, timeout=60)
    assert r.status_code == 400 and "Traceback" not in r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "cache_salt"


# --------------------------------------------------------------------------------- the CLI


@pytest.fixture
def served(monkeypatch) -> list[Engine]:
    """`llmc serve` stops short of serving: the engine it would serve is recorded, its socket closed."""
    from llmc.runtime import server as server_module

    engines: list[Engine] = []
    monkeypatch.setattr(server_module, "run_server", lambda engine, config, sock: (engines.append(engine),
                                                                                    sock.close()))
    return engines


def test_serve_maps_prefix_cache_salt_onto_the_engine(artifact, served):
    result = cli("serve", artifact, "--port", 0, "--kv-memory", "1MiB", "--prefix-cache-salt", "this-server")
    assert result.exit_code == 0, result.output
    assert served[0].config.prefix_cache_salt == "this-server"


def test_serve_refuses_an_empty_prefix_cache_salt(artifact, served):
    assert_cli_error(cli("serve", artifact, "--port", 0, "--prefix-cache-salt", ""),
                     "--prefix-cache-salt) must be 1 to 1024 characters")
    assert served == []
