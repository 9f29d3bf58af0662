"""Tensor parallelism over two CPU ranks (gloo): the same tokens as one rank,
through preemption too; workers start and stop with the engine, leave no
process behind, and a dead worker makes generation fail at once, naming it."""
import dataclasses
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.async_engine import AsyncLLMEngine
from pagedbackend.config import EngineConfig
from pagedbackend.kernels.kv_cache_dtype import cache_dtype
from pagedbackend.worker.model_runner import SeqEntry
from pagedbackend.models.linear import (QKVParallelLinear, RowParallelLinear, kv_heads_of_rank,
                                        query_heads_of_rank)
from loadtest.bench.broadcast import synthetic_decode_batch
from processes import children_of, processes_mentioning
from pagedbackend.worker.tp_protocol import (COPY, MESSAGE_LEN, SWAP_IN, SWAP_OUT, TensorParallelError,
                                             pack_step, unpack_step)

CPU = dict(device="cpu", attention_backend="torch", compile=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_prompts(n, seed=0, low=3, high=60):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lengths]


def token_ids(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


def alive(pid):
    """Running (a zombie nobody has reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def still_alive(pids, within=10.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def port_is_free(port):
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def our_workers():
    """This process's worker ranks (tests in other processes may run workers meanwhile)."""
    return set(processes_mentioning("pagedbackend.worker.tp_worker")) & set(children_of([os.getpid()]))


PROMPTS = make_prompts(8, seed=1)
BEAM = SamplingParams(temperature=0.0, max_tokens=12, n=2, use_beam_search=True)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir):
    """Greedy outputs of PROMPTS and a beam search, on one rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # several times faster than 2 on a busy 2-core machine
    try:
        llm = LLM(str(tiny_model_dir), num_kv_blocks=256, **CPU)
        return token_ids(llm.generate(PROMPTS, GREEDY)), token_ids(llm.generate(PROMPTS[:2], BEAM))
    finally:
        torch.set_num_threads(threads)


# ---- splitting ------------------------------------------------------------

def test_kv_heads_are_shared_out_whole_with_the_extra_ones_on_the_first_ranks():
    # SmolLM2: 9 query heads / 3 KV heads on 2 ranks.
    assert [kv_heads_of_rank(3, r, 2) for r in range(2)] == [(0, 2), (2, 1)]
    assert [query_heads_of_rank(9, 3, r, 2) for r in range(2)] == [(0, 6), (6, 3)]
    # Fewer KV heads than ranks: each is replicated, its query heads split.
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="not a multiple"):
        kv_heads_of_rank(2, 0, 3)


def test_uneven_head_split_reassembles_the_full_attention_projections():
    hidden, head_dim, heads, kv_heads = 16, 4, 9, 3
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    o = torch.randn(hidden, heads * head_dim)
    x = torch.randn(5, hidden)
    parts, partial_out = [], torch.zeros(5, hidden)
    for rank in range(2):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank, tp_size=2)
        for shard, weight in enumerate((q, k, v)):
            layer.load(shard, "weight", weight)
        parts.append(layer(x).split(layer.output_sizes_per_rank, dim=-1))
        o_proj = RowParallelLinear(heads * head_dim, hidden, tp_rank=rank, tp_size=2,
                                   reduce=lambda y: y, in_slice=layer.rank_slices[0])
        o_proj.load("weight", o)
        partial_out += o_proj(parts[-1][0])
    for i, weight in enumerate((q, k, v)):
        torch.testing.assert_close(torch.cat([p[i] for p in parts], dim=-1), x @ weight.T)
    torch.testing.assert_close(partial_out, (x @ q.T) @ o.T, rtol=1e-4, atol=1e-4)


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(tiny_model_dir):
    # 4 query heads / 2 KV heads cannot go over 3 ranks.
    workers = our_workers()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LLM(str(tiny_model_dir), tensor_parallel_size=3, num_kv_blocks=32, **CPU)
    assert our_workers() <= workers   # none was started


# ---- the step message -------------------------------------------------------

@pytest.mark.parametrize("num_seqs, context, broadcasts", [(1, 40, 1), (64, 512, 1), (64, 2048, 2)])
def test_step_message_round_trips_batch_and_block_moves(num_seqs, context, broadcasts):
    batch = synthetic_decode_batch(num_seqs, context)
    moves = [(SWAP_OUT, [(3, 0), (4, 1)]), (SWAP_IN, [(1, 7)]), (COPY, [(5, 6)])]
    tensors = pack_step(batch, moves)
    # Steps up to MESSAGE_LEN words travel as one broadcast, larger ones as two.
    assert len(tensors) == broadcasts and tensors[0].numel() == MESSAGE_LEN
    got, got_moves = unpack_step(tensors)
    assert got_moves == moves
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(got, name), getattr(batch, name))
    for name in ("slot_mapping", "block_tables", "cu_seqlens_q", "seq_lens"):
        want, have = getattr(batch.meta, name), getattr(got.meta, name)
        assert have.dtype == want.dtype and torch.equal(have, want)


# ---- two ranks ----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_two_ranks_generate_the_same_tokens_as_one(tiny_model_dir, one_rank):
    greedy, beams = one_rank
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=256, **CPU) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == greedy
        # Beam search forks sequences: copy-on-write block copies reach the worker.
        assert token_ids(llm.generate(PROMPTS[:2], BEAM)) == beams
        assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.timeout(120)
def test_ngram_speculation_on_two_ranks_gives_the_tokens_of_one(tiny_model_dir):
    # Prompts that end as they began, after the model's own continuation of
    # that beginning: n-grams are found at once and drafts verified
    # (multi-token entries and their logits rows through the ranks).
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 0}
    with LLM(str(tiny_model_dir), num_kv_blocks=256, **CPU) as llm:
        first = token_ids(llm.generate(PROMPTS[:4], GREEDY))
        prompts = [list(p) + out[0][:8] + list(p) for p, out in zip(PROMPTS[:4], first)]
        plain = token_ids(llm.generate(prompts, GREEDY))
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=256, speculative_config=spec, **CPU) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == plain
        assert llm.engine.get_stats().spec_num_draft_tokens > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_under_two_ranks_keeps_the_tokens(tiny_model_dir, one_rank, mode):
    greedy, _ = one_rank
    # 8 sequences of up to ~76 tokens need ~45 blocks of 8; 14 blocks force preemption.
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=14, block_size=8,
             preemption_mode=mode, swap_space_blocks=64 if mode == "swap" else 0, **CPU) as llm:
        outs = token_ids(llm.generate(PROMPTS, GREEDY))
        stats = llm.engine.get_stats()
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert outs == greedy


# Each rank holds its own KV heads' rows in the cache's format; a KV head's
# arithmetic is the same on either rank, so the tokens are those of one rank.
KV_BUDGET = 4 << 20   # kv_cache_bytes per rank: 64 float32 blocks of 16 for the whole tiny model


def _quantised_engine(folder, kv, tp, backend, **settings):
    return LLM(str(folder), tensor_parallel_size=tp, kv_cache_dtype=kv, dtype="float32",
               **dict(CPU, attention_backend=backend), **settings)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv, backend", [("int8", "sdpa"), ("bfloat16", "torch"), ("fp8_e4m3", "torch")])
def test_two_ranks_with_a_quantised_cache_give_the_tokens_of_one_and_its_tokens_per_byte(tiny_model_dir, kv,
                                                                                        backend):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _quantised_engine(tiny_model_dir, kv, 1, backend, kv_cache_bytes=KV_BUDGET) as llm:
            one, single = token_ids(llm.generate(PROMPTS, GREEDY)), llm.engine.runner
            single_cache, single_blocks = single.kv_cache, single.num_kv_blocks
    finally:
        torch.set_num_threads(threads)
    with _quantised_engine(tiny_model_dir, kv, 2, backend, kv_cache_bytes=KV_BUDGET) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == one
        rank0 = llm.engine.runner.runner
        assert rank0.kv_cache.dtype == single_cache.dtype == cache_dtype(kv, torch.float32)
        assert rank0.kv_cache.shape[-1] == single_cache.shape[-1]   # a row: its values (and int8's scales)
        # Half the KV heads a rank: each block takes half the bytes, so the
        # same kv_cache_bytes holds twice the blocks, each in the format's bytes.
        assert rank0.kv_bytes_per_block * 2 == single.kv_bytes_per_block
        assert llm.engine.block_manager.num_total_blocks == rank0.num_kv_blocks == \
            KV_BUDGET // rank0.kv_bytes_per_block >= 2 * single_blocks
        assert rank0.kv_cache.nbytes == rank0.num_kv_blocks * rank0.kv_bytes_per_block <= KV_BUDGET


@pytest.mark.timeout(120)
def test_swap_preemption_under_two_ranks_moves_int8_rows_with_their_scales(tiny_model_dir):
    # A pool of 14 blocks of 8 for 8 sequences that need ~45: swapped rows come
    # back byte for byte on both ranks, so the tokens are those of a roomy pool.
    with _quantised_engine(tiny_model_dir, "int8", 1, "torch", num_kv_blocks=256, block_size=8) as llm:
        roomy = token_ids(llm.generate(PROMPTS, GREEDY))
    with _quantised_engine(tiny_model_dir, "int8", 2, "torch", num_kv_blocks=14, block_size=8,
                           preemption_mode="swap", swap_space_blocks=64) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == roomy
        assert llm.engine.get_stats().num_swap_preemptions > 0


def test_int8_with_a_head_size_it_cannot_group_is_refused_before_any_worker_starts(tmp_path):
    from tiny_model import build_tiny_llama
    folder = build_tiny_llama(tmp_path / "heads_of_24", hidden_size=96, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=1)
    workers = our_workers()
    with pytest.raises(ValueError, match="int8 needs a head size that is a multiple of 16.*the model's is 24"):
        LLM(str(folder), tensor_parallel_size=2, kv_cache_dtype="int8", num_kv_blocks=32, **CPU)
    assert our_workers() <= workers   # none was started


@pytest.mark.timeout(60)
def test_engine_shutdown_stops_the_workers_and_frees_the_port(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=32, **CPU)
    engine = AsyncLLMEngine(config)   # what the Triton model's initialize / finalize use
    try:
        pids, port = engine.engine.runner.worker_pids, engine.engine.runner.master_port
        assert len(pids) == 1 and alive(pids[0])
        deltas = list(engine.add_request("r0", "Hello", SamplingParams(max_tokens=4, temperature=0.0)))
        assert deltas[-1].finished and deltas[-1].error is None
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == 4
    finally:
        engine.shutdown()
    assert still_alive(pids) == []
    assert port_is_free(port)
    with pytest.raises(TensorParallelError, match="shut down"):
        engine.engine.runner.execute_model([SeqEntry([5, 6], 0, [0])])


@pytest.mark.timeout(60)
def test_a_garbage_collected_engine_leaves_no_worker(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=32, **CPU)
    pids = llm.engine.runner.worker_pids
    del llm
    gc.collect()
    assert still_alive(pids) == []


@pytest.mark.timeout(60)
def test_workers_exit_when_their_parent_is_killed(tiny_model_dir):
    script = (f"import json, time\nfrom pagedbackend import LLM\n"
              f"llm = LLM({str(tiny_model_dir)!r}, tensor_parallel_size=2, num_kv_blocks=32, "
              f"device='cpu', attention_backend='torch')\n"
              f"print(json.dumps(llm.engine.runner.worker_pids), flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, cwd=REPO)
    try:
        pids = json.loads(parent.stdout.readline())
        assert pids and all(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    assert still_alive(pids) == []


@pytest.mark.timeout(90)
def test_a_worker_killed_mid_run_makes_generate_raise_naming_its_rank(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=64, **CPU)
    (pid,), port = llm.engine.runner.worker_pids, llm.engine.runner.master_port

    def kill_after_a_few_steps():
        deadline = time.monotonic() + 30
        while llm.engine.stats.num_steps < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_a_few_steps)
    killer.start()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    assert time.monotonic() - start < 20
    killer.join()
    assert port_is_free(port)
    with pytest.raises(TensorParallelError, match="rank 1"):   # it stays failed, no hang
        llm.generate(PROMPTS[:1], GREEDY)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_default_models_heads_split_unevenly_on_two_ranks_give_the_same_tokens_as_one(tmp_path,
                                                                                         default_model_dir):
    # SmolLM2's 9 query / 3 KV heads: rank 0 holds 2 KV heads, rank 1 holds 1.
    # A tiny random model with that head layout: the split depends on the
    # heads, not the weights (two loads of the default model took half a minute).
    from tiny_model import build_tiny_llama
    folder = str(build_tiny_llama(tmp_path / "nine_heads", seed=3, num_hidden_layers=2, hidden_size=288,
                                  num_attention_heads=9, num_key_value_heads=3))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    one = token_ids(LLM(folder, num_kv_blocks=64, **CPU).generate(prompts, params))
    gc.collect()
    with LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, **CPU) as llm:
        assert token_ids(llm.generate(prompts, params)) == one


# ---- settings (EngineConfig's tp_* fields) ----------------------------------

def test_a_worker_takes_its_timeouts_from_rank_0s_config(tiny_model_dir, monkeypatch):
    """A worker reads the engine config from rank 0's store and forms its
    process group with that config's tp_timeout_s (the step itself is not
    run: ModelRunner and the groups are replaced; the store is real)."""
    import torch.distributed as dist
    from datetime import timedelta
    from pagedbackend.worker import tp_worker
    from pagedbackend.worker.tp_protocol import CONFIG_KEY, loaded_key
    config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, tp_timeout_s=7.5, **CPU)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(config)))
    seen = {}

    def init_groups(device, store, rank, world, timeout_s):
        seen["timeout_s"] = timeout_s
        raise RuntimeError("stop before the groups")
    monkeypatch.setattr(tp_worker, "ModelRunner", lambda config, rank, world: seen.setdefault("config", config))
    monkeypatch.setattr(tp_worker, "init_groups", init_groups)
    threads = torch.get_num_threads()
    try:
        code = tp_worker.run_worker(1, 2, "127.0.0.1", store.port, local_size=2, rendezvous_s=30)
    finally:
        torch.set_num_threads(threads)
    assert code == 1 and store.get(loaded_key(1)) == b""
    assert seen == {"config": config, "timeout_s": 7.5}


@pytest.mark.timeout(60)
def test_rank_0_waits_tp_rendezvous_s_for_ranks_it_does_not_start(tiny_model_dir):
    """tp_local_size 1: rank 0 starts no worker and waits tp_rendezvous_s for
    rank 1 (a remote rank), then fails naming it."""
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] did not load within 2 s"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2, tp_local_size=1, tp_rendezvous_s=2,
            num_kv_blocks=32, **CPU)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(90)
def test_a_hung_worker_fails_the_step_after_tp_timeout_s(tiny_model_dir):
    """A worker that stops answering (SIGSTOP) fails the step once a collective
    has waited tp_timeout_s, not the default 120 s; the worker was started
    with rank 0's tp_rendezvous_s."""
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, tp_timeout_s=3, tp_rendezvous_s=45,
              num_kv_blocks=64, **CPU)
    (pid,) = llm.engine.runner.worker_pids
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert "\x00--rendezvous-s\x0045\x00" in f.read().decode()
    llm.generate(PROMPTS[:1], GREEDY)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel step failed"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 20
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
        llm.shutdown()
    assert still_alive([pid]) == []
