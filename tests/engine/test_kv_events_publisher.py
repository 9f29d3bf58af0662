"""The engine's KV-cache events over ZMQ, as vLLM publishes them
(``kv_events_config``): a subscriber that applies every batch in order holds
exactly the engine's prefix cache (every block stored, every eviction removed
leaves first, a reset cleared), sequence numbers run without gaps, a late
subscriber gets the batches again from the replay socket, and with events off
nothing is published. On the tiny random model."""
import msgpack
import pytest

from kv_router_view import RouterView, Subscriber, decode_event, replay
from pagedbackend import LLM, SamplingParams
from pagedbackend.core.kv_events import AllBlocksCleared
from loadtest.harness.triton import free_port

BLOCK = 16
# 12 blocks of 16 positions: the rounds below fill the cache and evict from it.
SETTINGS = dict(compile=False, device="cpu", num_kv_blocks=12, block_size=BLOCK, max_num_seqs=4,
                watermark=0.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(round_no: int) -> list:
    """Two shared stems, each continued three ways; a new stem every round."""
    stems = [[1000 + 37 * round_no + i for i in range(40)], [5000 + i for i in range(24)]]
    return [stem + [200 + 11 * j + round_no] * (3 + j) for stem in stems for j in range(3)]


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_a_subscriber_holds_exactly_the_engines_prefix_cache(tiny_model_dir, endpoints):
    endpoint, replay_endpoint = endpoints
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay_endpoint, "topic": "kv-events"}
    llm = LLM(model=str(tiny_model_dir), kv_events_config=config, **SETTINGS)
    subscriber = Subscriber(endpoint, "kv-events")
    try:
        pool, router, seen = llm.engine.block_manager.pool, RouterView(BLOCK), []
        for round_no in range(3):
            llm.generate(prompts(round_no), GREEDY)
            batches = subscriber.read()
            assert batches, "a round that computed full blocks published nothing"
            for seq, events in batches:
                router.apply(events)
            seen += batches
            assert router.blocks == router.expected(pool)
        assert pool.num_evictions > 0, "the rounds were meant to evict cached blocks"
        llm.engine.reset_prefix_cache()
        (seq, events), = subscriber.read()
        assert [type(e) for e in events] == [AllBlocksCleared]
        seen.append((seq, events))
        assert [s for s, _ in seen] == list(range(len(seen)))   # no gap, in order

        replayed = replay(replay_endpoint, 2)   # a late subscriber catches up from batch 2
        assert [s for s, _ in replayed] == list(range(2, len(seen)))
        for (seq, payload), (_, events) in zip(replayed, seen[2:]):
            assert [decode_event(e) for e in msgpack.unpackb(payload)[1]] == events
    finally:
        subscriber.close()
        llm.shutdown()


@pytest.mark.parametrize("config", [{"enable_kv_cache_events": False},
                                    {"enable_kv_cache_events": True, "publisher": "null"}])
def test_with_events_off_nothing_is_published(tiny_model_dir, endpoints, config):
    endpoint, _ = endpoints
    llm = LLM(model=str(tiny_model_dir), kv_events_config={**config, "endpoint": endpoint}, **SETTINGS)
    subscriber = Subscriber(endpoint)
    try:
        llm.generate(prompts(0), GREEDY)
        assert llm.engine.block_manager.pool.cached, "blocks were cached"
        assert llm.engine.block_manager.pool.events is None
        assert subscriber.read() == []
    finally:
        subscriber.close()
        llm.shutdown()


def test_a_bad_setting_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_events_config: unknown field.*endpiont"):
        LLM(model=str(tiny_model_dir), kv_events_config={"endpiont": "tcp://127.0.0.1:1"}, **SETTINGS)
    with pytest.raises(ValueError, match="publisher must be zmq or null"):
        LLM(model=str(tiny_model_dir), kv_events_config={"publisher": "kafka"}, **SETTINGS)
