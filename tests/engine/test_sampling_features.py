"""vLLM's logits-shaping parameters through the engine: repetition penalty
equal to Hugging Face's, presence / frequency penalties, logit bias, allowed
tokens, bad words and prompt truncation, on the tiny random Llama."""
import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.sample.sampler import SampleRow, sample


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), num_kv_blocks=128, compile=False)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 30, (n,), generator=g)]


@pytest.mark.parametrize("penalty", [0.3, 1.8])
def test_repetition_penalty_equals_hugging_face(tiny_model_dir, llm, penalty):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=penalty, ignore_eos=True)

    ours = [o.outputs[0].token_ids for o in llm.generate(batch, params)]

    expected = []
    with torch.no_grad():
        for p in batch:
            out = hf.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                              repetition_penalty=penalty, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            expected.append(out[0, len(p):].tolist())
    assert ours == expected
    if penalty < 1:   # rewarding repeats changes the random model's greedy text
        plain = [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True))]
        assert plain != ours


def test_presence_and_frequency_penalties_subtract_per_generated_token():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0
    logits[0, 4] = 4.6
    history = [7, 7, 3, 3, 3]            # prompt [7, 7], output [3, 3, 3]
    row = SampleRow(0, SamplingParams(temperature=0.0, presence_penalty=0.2, frequency_penalty=0.1),
                    token_ids=history, num_prompt_tokens=2)

    picked = sample(logits, [row])[0]

    assert logits[0, 3].item() == pytest.approx(5.0 - 0.2 - 3 * 0.1)
    assert logits[0, 7].item() == 0.0     # prompt tokens carry no presence / frequency penalty
    assert picked.token_id == 4           # 4.6 now beats token 3 (4.5 after the penalties)


def test_logit_bias_and_allowed_token_ids_steer_greedy_decoding(llm):
    forced = llm.generate([[500, 600, 700]], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={"1234": 100}))[0].outputs[0]
    allowed = llm.generate([[500, 600, 700]], SamplingParams(
        temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=[11, 22, 33]))[0].outputs[0]

    assert forced.token_ids == [1234] * 6
    assert set(allowed.token_ids) <= {11, 22, 33} and len(allowed.token_ids) == 12


def test_bad_words_never_appear_in_the_output(llm):
    tokenizer = llm.get_tokenizer()
    batch = prompts(4, seed=5)
    free = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    words = sorted({w for o in free for w in o.outputs[0].text.split() if w.isalpha()}, key=len)[-3:]
    assert words   # the tiny model's greedy text has some words to ban

    banned = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                bad_words=words))
    for out in banned:
        ids = out.outputs[0].token_ids
        for word in words:
            for form in (word, " " + word):
                seq = tokenizer.encode(form, add_special_tokens=False)
                assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))
    assert [o.outputs[0].token_ids for o in banned] != [o.outputs[0].token_ids for o in free]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = list(range(100, 140))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=8))[0]
    same = llm.generate([prompt[-8:]], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.prompt_token_ids == prompt[-8:]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_logprobs_up_to_the_limit_with_ranks(llm):
    out = llm.generate([[9, 99, 999]], SamplingParams(temperature=0.7, seed=2, max_tokens=4, logprobs=20))[0]
    for token, entries in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert 20 <= len(entries) <= 21 and token in entries
        ranked = sorted(entries.values(), key=lambda e: e.rank)
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert entries[token].rank >= 1


@pytest.mark.parametrize("width", [100, 4096, 49152, 32000, 151936])
def test_row_argmax_gives_torchs_argmax(width):
    from pagedbackend.sample.sampler import row_argmax
    torch.manual_seed(width)
    logits = torch.randn(7, width)
    logits[1, :] = 0.5                        # every value equal: the first
    logits[2, [5, width - 1]] = 100.0         # a tie across blocks: the first
    logits[3, width - 1] = 100.0              # the maximum in the last, shorter block
    logits[4, [17, width // 2]] = float("nan")  # NaN counts as the largest, the first one
    logits[5, :] = float("-inf")
    logits[5, width - 2] = 0.0
    got = row_argmax(logits)
    assert torch.equal(got, logits.argmax(dim=-1)), (got, logits.argmax(dim=-1))
    assert got[2].item() == 5 and got[3].item() == width - 1 and got[4].item() == 17
