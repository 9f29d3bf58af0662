"""The disk tier below the prefix cache (``kv_offload_dir``) in a real
engine on the tiny random Llama: a long prompt evicted from a small pool
comes back from disk, in the same engine, in a fresh one on the same
folder and in a replica sharing it, with Hugging Face's greedy tokens; a torn, corrupt or mismatching
file is refused and its block recomputed; the folder never holds more than
``kv_offloading_size``; an int8 cache's bytes (scales included) round-trip;
a cache salt or an adapter never reads another's blocks; KV events name
the medium. Files are corrupted for real, by editing their bytes."""
import shutil

import pytest
import torch

from kv_router_view import Subscriber
from loadtest.harness.triton import free_port
from pagedbackend import LLM, LoRARequest, SamplingParams
from pagedbackend.config import EngineConfig, engine_config
from pagedbackend.core.kv_events import BlockRemoved, BlockStored, external_hash
from pagedbackend.core.prefix_cache import block_hashes
from peft_reference import save_random_adapter
from runner_reference import greedy_hf

BLOCK = 8
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 30 blocks of 8: the long prompt's 20 full blocks are evicted by the others.
SETTINGS = dict(compile=False, dtype="float32", device="cpu", num_kv_blocks=30, block_size=BLOCK)
LONG = [100 + (37 * i) % 3000 for i in range(20 * BLOCK + 3)]
FULL_BLOCKS = (len(LONG) - 1) // BLOCK   # the last token is always computed


def others(round_no=0):
    return [[5000 + 400 * round_no + 61 * i + j for j in range(60)] for i in range(6)]


def tiered(model_dir, folder, **settings):
    return LLM(model=str(model_dir), kv_offload_dir=str(folder), **{**SETTINGS, **settings})


def run(llm, prompt=LONG, params=GREEDY, **kwargs):
    return llm.generate([prompt], params, **kwargs)[0].outputs[0].token_ids


def evict(llm, round_no=0):
    """Push every cached block of earlier prompts out of the pool, to disk."""
    llm.generate(others(round_no), GREEDY)
    assert llm.engine.kv_tier.flush()


def loaded(llm):
    return llm.engine.get_stats().kv_offload_loaded


@pytest.fixture(scope="module")
def hf_tokens(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    return greedy_hf(hf, [LONG], MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def filled(tmp_path_factory, tiny_model_dir):
    """A folder holding the long prompt's blocks (written by an engine that
    then shut down), and each block's file name, in prompt order."""
    folder = tmp_path_factory.mktemp("kv_tier")
    llm = tiered(tiny_model_dir, folder)
    first = run(llm)
    evict(llm)
    bm = llm.engine.block_manager
    names = [llm.engine.kv_tier.name(h) for h in block_hashes(LONG, BLOCK, bm._key(b""), limit=FULL_BLOCKS)]
    stats = llm.engine.get_stats()
    llm.shutdown()
    return folder, names, first, stats


def test_an_evicted_prefix_is_loaded_from_disk_with_hugging_faces_tokens(tiny_model_dir, tmp_path, hf_tokens):
    llm = tiered(tiny_model_dir, tmp_path)
    first = run(llm)
    evict(llm)
    before = llm.engine.get_stats()
    assert before.kv_offload_saved >= FULL_BLOCKS and before.kv_offload_loaded == 0
    again = run(llm)
    after = llm.engine.get_stats()
    assert after.kv_offload_loaded - before.kv_offload_loaded == FULL_BLOCKS
    assert after.prefix_cache_hits - before.prefix_cache_hits == FULL_BLOCKS * BLOCK
    assert again == first == hf_tokens
    assert llm.engine.check_idle() == []
    llm.shutdown()


def test_a_fresh_engine_on_the_same_folder_loads_the_prefix(tiny_model_dir, tmp_path, filled, hf_tokens):
    folder, names, first, stats = filled
    assert stats.kv_offload_saved >= FULL_BLOCKS and first == hf_tokens
    shutil.copytree(folder, tmp_path / "copy")
    llm = tiered(tiny_model_dir, tmp_path / "copy")
    assert llm.engine.get_stats().kv_offload_bytes >= FULL_BLOCKS * llm.engine.kv_tier.block_bytes
    assert run(llm) == hf_tokens
    assert loaded(llm) == FULL_BLOCKS
    llm.shutdown()


def test_a_restart_finds_the_prefixes_the_pool_held_at_shutdown(tiny_model_dir, tmp_path, hf_tokens):
    llm = tiered(tiny_model_dir, tmp_path)
    run(llm)
    assert llm.engine.get_stats().kv_offload_saved == 0   # nothing evicted: all of it still in the pool
    llm.shutdown()   # the pool's cached blocks are written
    fresh = tiered(tiny_model_dir, tmp_path)
    assert run(fresh) == hf_tokens and loaded(fresh) == FULL_BLOCKS
    fresh.shutdown()


def test_a_replica_sharing_the_folder_reads_blocks_another_wrote_after_it_started(tiny_model_dir, tmp_path,
                                                                                 hf_tokens):
    reader = tiered(tiny_model_dir, tmp_path)   # indexed an empty folder
    writer = tiered(tiny_model_dir, tmp_path)
    run(writer)
    evict(writer)
    assert run(reader) == hf_tokens and loaded(reader) == FULL_BLOCKS
    writer.shutdown()
    reader.shutdown()


def _flip_payload_byte(data: bytes) -> bytes:
    return data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:]


CORRUPTIONS = {
    "flipped payload byte": _flip_payload_byte,
    "torn (half written)": lambda data: data[:len(data) // 2],
    "another layout": lambda data: data.replace(b'"block_size": 8', b'"block_size": 4', 1),
    "not a block file": lambda data: b"\0" * len(data),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_file_is_refused_and_its_block_recomputed(tiny_model_dir, tmp_path, filled, hf_tokens,
                                                            corruption):
    folder, names, _, _ = filled
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    damaged = copy / names[3]
    data = damaged.read_bytes()
    damaged.write_bytes(CORRUPTIONS[corruption](data))
    assert damaged.read_bytes() != data
    llm = tiered(tiny_model_dir, copy)
    assert run(llm) == hf_tokens
    stats = llm.engine.get_stats()
    assert (stats.kv_offload_loaded, stats.kv_offload_refused) == (3, 1)   # blocks 0-2 read, 3 refused
    assert not damaged.exists()
    llm.shutdown()


def test_the_folder_never_holds_more_than_its_bound(tiny_model_dir, tmp_path):
    block_bytes = 2 * 4 * BLOCK * 2 * 64 * 4   # K and V x 4 layers x 8 positions x 2 KV heads x 64 x float32
    bound = 10 * (block_bytes + 1024)
    llm = tiered(tiny_model_dir, tmp_path, kv_offloading_size=bound / 2 ** 30)
    assert llm.engine.kv_tier.block_bytes == block_bytes
    for round_no in range(4):
        run(llm, [7000 + 500 * round_no + i for i in range(20 * BLOCK)])
        evict(llm, round_no)
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
        assert on_disk <= bound and llm.engine.kv_tier.num_bytes == on_disk
    stats = llm.engine.get_stats()
    assert stats.kv_offload_saved > 20 and stats.kv_offload_evicted >= stats.kv_offload_saved - 10
    llm.shutdown()
    smaller = tiered(tiny_model_dir, tmp_path, kv_offloading_size=4 * (block_bytes + 1024) / 2 ** 30)
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 4 * (block_bytes + 1024)   # shrunk at start
    smaller.shutdown()


def test_an_int8_cache_round_trips_through_disk_and_stays_apart(tiny_model_dir, tmp_path, hf_tokens):
    llm = tiered(tiny_model_dir, tmp_path, kv_cache_dtype="int8")
    first = run(llm)
    evict(llm)
    assert run(llm) == first   # the rows come back byte for byte, their scales with them
    assert loaded(llm) == FULL_BLOCKS
    llm.shutdown()
    plain = tiered(tiny_model_dir, tmp_path)   # float32 cache: the int8 files are not its blocks
    assert run(plain) == hf_tokens and loaded(plain) == 0
    plain.shutdown()


def test_a_cache_salt_or_an_adapter_never_reads_anothers_blocks(tiny_model_dir, tmp_path, hf_tokens):
    adapter = LoRARequest("alpha", 1, save_random_adapter(tiny_model_dir, tmp_path / "alpha", r=4, lora_alpha=8,
                                                          seed=1))
    llm = tiered(tiny_model_dir, tmp_path / "tier", enable_lora=True, max_lora_rank=8)
    salted = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, cache_salt="tenant-a")
    with_adapter = run(llm, lora_request=adapter)
    with_salt = run(llm, params=salted)
    evict(llm)
    assert run(llm) == hf_tokens and loaded(llm) == 0   # neither the adapter's nor the salt's blocks
    other_salt = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, cache_salt="tenant-b")
    run(llm, params=other_salt)
    assert loaded(llm) == 0
    evict(llm, 1)
    assert run(llm, lora_request=adapter) == with_adapter and loaded(llm) == FULL_BLOCKS
    assert run(llm, params=salted) == with_salt and loaded(llm) == 2 * FULL_BLOCKS
    llm.shutdown()


def test_events_name_the_pool_and_the_disk_as_their_medium(tiny_model_dir, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    llm = tiered(tiny_model_dir, tmp_path, kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                                             "endpoint": endpoint})
    subscriber = Subscriber(endpoint)
    try:
        run(llm)
        evict(llm)
        llm.engine.kv_events.flush()   # the tier's events of the writes after the last step
        events = [e for _, batch in subscriber.read() for e in batch]
        assert {e.medium for e in events} == {"CPU", "DISK"}
        on_disk = set()
        for event in events:
            if event.medium == "DISK" and isinstance(event, BlockStored):
                on_disk.update(event.block_hashes)
            elif event.medium == "DISK" and isinstance(event, BlockRemoved):
                on_disk.difference_update(event.block_hashes)
        bm = llm.engine.block_manager
        long_hashes = {external_hash(h) for h in block_hashes(LONG, BLOCK, bm._key(b""), limit=FULL_BLOCKS)}
        assert long_hashes <= on_disk   # a router can count the long prompt's prefix on disk
    finally:
        subscriber.close()
        llm.shutdown()


@pytest.mark.parametrize("settings,message", [
    (dict(kv_offloading_size=0), "kv_offloading_size must be > 0"),
    (dict(kv_offloading_size=-2.5), "kv_offloading_size must be > 0"),
    (dict(kv_offload_dir="/proc/no-such/tier"), "cannot be created"),
    (dict(kv_offload_dir="/tmp", tensor_parallel_size=2), "tensor_parallel_size=1"),
])
def test_bad_tier_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_config_pbtxt_strings_become_the_tier_settings(tmp_path):
    config = engine_config({"kv_offload_dir": {"string_value": str(tmp_path / "new")},
                            "kv_offloading_size": {"string_value": "0.5"}}, environ={})
    assert (config.kv_offload_dir, config.kv_offloading_size) == (str(tmp_path / "new"), 0.5)
    assert (tmp_path / "new").is_dir()


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        EngineConfig(kv_offload_dir=str(tmp_path / "file"))
