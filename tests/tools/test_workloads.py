"""Synthetic workloads: determinism, target statistics, shared prefixes."""
import math

import numpy as np
import pytest

from loadtest.workloads import (
    PREFIX_LEN, Request, alpaca_like, make_prompt_token_ids, make_text_prompts,
    make_trace, poisson_arrivals, shared_prefix, sharegpt_like)

N = 4000
# Sample means of N heavy-tailed lengths stay within this of the target; the
# standard error is about 2 % for ShareGPT-like outputs at N = 4000.
MEAN_TOLERANCE = 0.07


class WordPieceTokenizer:
    """Stands in for a real tokenizer: three characters of a word per token."""

    def encode(self, text, add_special_tokens=False):
        return [hash(w[i:i + 3]) for w in text.split() for i in range(0, len(w), 3)]


def lengths(trace):
    return (np.array([r.prompt_len for r in trace]), np.array([r.output_len for r in trace]))


@pytest.mark.parametrize("make", [sharegpt_like, alpaca_like,
                                  lambda n, seed: shared_prefix(n, seed, shots=5)])
def test_trace_is_deterministic_for_a_seed_and_differs_across_seeds(make):
    assert make(200, 7) == make(200, 7)
    assert make(200, 7) != make(200, 8)


@pytest.mark.parametrize("make, input_mean, output_mean", [
    (sharegpt_like, 161, 338), (alpaca_like, 19, 58)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_means_match_paper_statistics(make, input_mean, output_mean, seed):
    prompts, outputs = lengths(make(N, seed))

    assert prompts.mean() == pytest.approx(input_mean, rel=MEAN_TOLERANCE)
    assert outputs.mean() == pytest.approx(output_mean, rel=MEAN_TOLERANCE)


def test_sharegpt_like_is_heavy_tailed_and_fits_the_model_length():
    prompts, outputs = lengths(sharegpt_like(N, 0, max_model_len=2048))
    total = prompts + outputs

    assert prompts.min() >= 1 and outputs.min() >= 1
    assert total.max() <= 2048
    # Heavy tail: the mean sits well above the median, some requests are long.
    assert np.median(outputs) < 0.8 * outputs.mean()
    assert np.percentile(total, 99) > 3 * total.mean()


@pytest.mark.parametrize("shots", [1, 5])
def test_shared_prefix_requests_carry_the_few_shot_prefix(shots):
    trace = shared_prefix(500, 0, shots=shots)

    assert {r.prefix_len for r in trace} == {PREFIX_LEN[shots]}
    assert all(r.prompt_len > r.prefix_len and r.output_len >= 1 for r in trace)
    assert len({r.prompt_len for r in trace}) > 1  # distinct suffixes


def test_shared_prefix_rejects_other_shot_counts():
    with pytest.raises(ValueError, match="shots"):
        shared_prefix(10, 0, shots=3)


def test_make_trace_by_name():
    assert make_trace("alpaca", 50, 3) == alpaca_like(50, 3)
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("wmt", 10, 0)


# ---------------------------------------------------------------- arrivals

def test_poisson_inter_arrival_mean_is_inverse_rate():
    times = np.array(poisson_arrivals(rate=4.0, num_requests=10_000, seed=0))
    gaps = np.diff(times, prepend=0.0)

    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)


def test_poisson_arrivals_are_deterministic_and_infinite_rate_is_a_burst():
    assert poisson_arrivals(2.0, 100, 1) == poisson_arrivals(2.0, 100, 1)
    assert poisson_arrivals(2.0, 100, 1) != poisson_arrivals(2.0, 100, 2)
    assert poisson_arrivals(math.inf, 3, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, 0)


# ---------------------------------------------------------------- token ids

def test_prompt_token_ids_have_trace_lengths_and_stay_in_range():
    trace = alpaca_like(300, 0)

    ids = make_prompt_token_ids(trace, vocab_size=49152, seed=0, low=100, high=1000)

    assert [len(p) for p in ids] == [r.prompt_len for r in trace]
    flat = np.concatenate(ids)
    assert flat.min() >= 100 and flat.max() < 1000
    assert ids == make_prompt_token_ids(trace, 49152, 0, low=100, high=1000)
    assert ids != make_prompt_token_ids(trace, 49152, 1, low=100, high=1000)


def test_shared_prefix_requests_really_share_prefix_tokens():
    trace = shared_prefix(100, 0, shots=5)

    ids = make_prompt_token_ids(trace, vocab_size=49152, seed=0)

    prefix = ids[0][:340]
    assert all(p[:340] == prefix for p in ids)
    assert len({tuple(p[340:]) for p in ids}) == len(ids)  # suffixes differ


def test_given_prefix_token_ids_are_used_verbatim():
    trace = [Request(prompt_len=5, output_len=1, prefix_len=3), Request(4, 1, 0)]

    ids = make_prompt_token_ids(trace, vocab_size=100, seed=0, prefix_token_ids=[7, 8, 9], low=10)

    assert ids[0][:3] == [7, 8, 9] and len(ids[0]) == 5
    assert len(ids[1]) == 4 and min(ids[1]) >= 10
    with pytest.raises(ValueError, match="prefix_token_ids"):
        make_prompt_token_ids(trace, 100, 0, prefix_token_ids=[7, 8], low=10)


def test_token_range_must_fit_the_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        make_prompt_token_ids(alpaca_like(3, 0), vocab_size=100, seed=0, low=50, high=200)


# ---------------------------------------------------------------- text

def test_text_prompts_have_about_the_right_token_length():
    tokenizer = WordPieceTokenizer()
    trace = alpaca_like(100, 0) + sharegpt_like(30, 0)

    prompts = make_text_prompts(trace, tokenizer, seed=0)

    errors = [abs(len(tokenizer.encode(p)) - r.prompt_len) for p, r in zip(prompts, trace)]
    assert max(errors) <= 2  # a word is at most three tokens here
    assert prompts == make_text_prompts(trace, tokenizer, seed=0)


def test_text_prompts_share_the_prefix_text():
    prompts = make_text_prompts(shared_prefix(20, 0, shots=1), WordPieceTokenizer(), seed=0)
    common = prompts[0]
    for p in prompts[1:]:
        while not p.startswith(common):
            common = common[:-1]

    assert len(WordPieceTokenizer().encode(common)) >= PREFIX_LEN[1] - 2
