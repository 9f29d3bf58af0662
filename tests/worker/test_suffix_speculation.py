"""Suffix speculation (spec_decode/suffix_index.py, SuffixProposer): the longest
suffix match and the most frequent continuation, bounded memory, tenants
that share nothing, and on a real model greedy tokens equal to plain
decoding with an earlier answer drafted only for its own tenant."""
import dataclasses
import random

import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.config import SpeculativeConfig
from pagedbackend.core.scheduled import ScheduledSeq
from pagedbackend.core.sequence import SequenceGroup
from pagedbackend.spec_decode.proposers import SuffixProposer
from pagedbackend.spec_decode.suffix_index import SuffixIndex, walk


def test_match_finds_the_longest_suffix_and_every_occurrence_of_it():
    index = SuffixIndex()
    index.add([7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 2, 3, 6])
    length, cands = index.match([0, 1, 2, 3], depth=24)
    assert length == 3   # "1 2 3" twice; "2 3" alone also after 8, but shorter
    assert sorted(at for _, at in cands) == [4, 9]
    assert index.match([0, 1, 2, 3], depth=2)[0] == 2   # the depth bounds the match
    assert index.match([5, 5], depth=24) == (0, [])


def test_walk_follows_the_majority_and_stops_below_the_probability_floor():
    index = SuffixIndex()
    for tail in ([4, 5, 6], [4, 5, 7], [4, 8, 9]):
        index.add([1, 2, 3] + tail)
    _, cands = index.match([1, 2, 3], depth=24)
    draft, score = walk(cands, limit=3, min_prob=0.1)
    assert draft == [4, 5, 7]   # 4 (3 of 3), 5 (2 of 3), then a tie, the newest
    assert score == pytest.approx(1 + 2 / 3 + 1 / 3)
    assert walk(cands, limit=3, min_prob=0.5)[0] == [4, 5]
    assert walk(cands, limit=1, min_prob=0.1)[0] == [4]


def test_dropping_the_oldest_document_leaves_the_index_of_the_rest():
    rng = random.Random(0)
    docs = [[rng.randrange(6) for _ in range(rng.randint(3, 40))] for _ in range(8)]
    index, rest = SuffixIndex(per_key=1000), SuffixIndex(per_key=1000)
    for doc in docs:
        index.add(doc)
    for doc in docs[3:]:
        rest.add(doc)
    for _ in range(3):
        index.pop_oldest()
    shifted = {key: [entry - (3 << 32) for entry in found] for key, found in index._where.items()}   # ids 3.. vs 0..
    assert shifted == rest._where and index.num_tokens == rest.num_tokens


def test_a_growing_document_is_indexed_as_it_grows():
    tokens = [1, 2, 3]
    index = SuffixIndex()
    index.add(tokens)
    assert index.match(tokens + [], depth=24) == (0, [])   # the only "2 3" is the end itself
    tokens += [4, 1, 2, 3]
    index.extend(0)
    length, cands = index.match(tokens, depth=24)
    assert length == 3 and walk(cands, 8, 0.1)[0] == [4, 1, 2, 3]   # up to the end, no further


def _group(prompt, salt=None, request_id="r"):
    return SequenceGroup(request_id, None, prompt, SamplingParams(max_tokens=64, cache_salt=salt), 0.0, 64)


def _finish(group, output):
    seq = group.seqs[0]
    seq.token_ids.extend(output)
    seq.finish_reason = "stop"
    group.finished_seqs, group.seqs = [seq], []
    return group


def _propose(proposer, group, n=24):
    item = ScheduledSeq(token_ids=[], start_pos=0, block_table=[], group=group, seq=group.seqs[0], num_lookahead=n)
    return proposer.propose([(item, n)])[0]


def test_an_answer_is_drafted_again_for_its_own_tenant_only():
    question, answer = [5, 6, 7, 8, 9, 10, 9, 8, 7, 6], [11, 12, 13, 14, 15, 16, 17, 18]
    proposer = SuffixProposer(SpeculativeConfig("suffix"))
    proposer.remember(_finish(_group(question, "tenant-a"), answer))
    assert _propose(proposer, _group(question, "tenant-a")) == answer   # the whole answer at once (match: 10)
    assert _propose(proposer, _group(question, "tenant-b")) == []
    assert _propose(proposer, _group(question)) == []                   # no salt is a tenant too


def test_another_tenants_answers_change_no_draft():
    rng = random.Random(1)
    spec = SpeculativeConfig("suffix", suffix_decoding_max_cached_requests=5)
    alone, beside = SuffixProposer(spec), SuffixProposer(spec)
    for i in range(20):   # the same questions and answers for tenant b, and tenant a's traffic beside
        question, answer = [rng.randrange(8) for _ in range(6)], [rng.randrange(8) for _ in range(12)]
        other = [rng.randrange(8) for _ in range(18)]
        beside.remember(_finish(_group(other[:6], "a", f"a{i}"), other[6:]))
        drafts = [_propose(p, _group(question + answer[:k], "b", f"b{i}")) for p in (alone, beside)
                  for k in (0, 3, 7)]
        assert drafts[:3] == drafts[3:]
        for p in (alone, beside):
            p.remember(_finish(_group(question, "b", f"b{i}"), answer))
    assert alone._tenants[b"b"]._where == beside._tenants[b"b"]._where
    assert b"a" in beside._tenants and beside._tenants[b"a"] is not beside._tenants[b"b"]


def test_memory_stays_within_the_bounds_per_tenant_and_in_tenants():
    spec = SpeculativeConfig("suffix", suffix_decoding_max_cached_requests=4, suffix_decoding_max_cached_tokens=150,
                             suffix_decoding_max_tenants=3)
    proposer = SuffixProposer(spec)
    rng = random.Random(2)
    for i in range(60):
        output = [rng.randrange(50) for _ in range(rng.randint(1, 70))]
        proposer.remember(_finish(_group([1, 2, 3], f"t{i % 5}", f"r{i}"), output))
        assert len(proposer._tenants) <= 3
        for index in proposer._tenants.values():
            assert len(index.docs) <= 4 and index.num_tokens <= 150
            assert sum(len(found) for found in index._where.values()) == index.num_tokens
    assert list(proposer._tenants) == [b"t2", b"t3", b"t4"]   # the least recently used went first
    off = SuffixProposer(SpeculativeConfig("suffix", suffix_decoding_max_cached_requests=0))
    off.remember(_finish(_group([1, 2, 3]), [4, 5, 6]))
    assert not off._tenants


@pytest.mark.slow
def test_greedy_tokens_equal_plain_decoding_and_a_repeated_question_is_drafted_whole(default_model_dir):
    prompt = "<|im_start|>user\nWhy do cats purr?<|im_end|>\n<|im_start|>assistant\n"
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    settings = dict(model=str(default_model_dir), num_kv_blocks=128, compile=False)
    with LLM(**settings) as llm:
        plain = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    with LLM(**settings, speculative_config={"method": "suffix"}) as llm:
        runs = []
        for salt in ("a", "a", "b"):
            before = llm.engine.get_stats()
            tokens = llm.generate([prompt], dataclasses.replace(greedy, cache_salt=salt))[0] \
                .outputs[0].token_ids
            after = llm.engine.get_stats()
            runs.append((tokens, after.num_steps - before.num_steps,
                         after.spec_num_accepted_tokens - before.spec_num_accepted_tokens))
    assert all(tokens == plain for tokens, _, _ in runs)
    (_, first_steps, _), (_, again_steps, again_accepted), (_, other_steps, _) = runs
    assert again_accepted >= 40 and again_steps <= 6      # the earlier answer, 24 tokens a step
    assert other_steps == first_steps                     # tenant b drafts as if a had asked nothing
