"""The fleet benchmark's oracle: one cache that holds, in full blocks, every
request finished before a request starts (its prompt and answer) and never
forgets; a prompt's last token is always computed. And its chats: every turn
of a chat resends the history, lengths capped as asked."""
from loadtest.bench.fleet import PrefixOracle, chat_workload, oracle_hit_rate


class CharTokenizer:
    """One token per character; the chat template joins the turns with '|'."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("|".join(m["content"] for m in messages) + "|")


def test_the_oracle_counts_full_blocks_of_the_longest_seen_prefix():
    oracle = PrefixOracle(block=4)
    oracle.add(list(range(10)))                   # blocks [0..3], [4..7] are held
    assert oracle.cached(list(range(10))) == 8
    assert oracle.cached(list(range(8))) == 4     # the last token is computed: 7 tokens may hit, 1 block
    assert oracle.cached([0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4
    assert oracle.cached([9] + list(range(9))) == 0


def test_the_oracle_holds_only_what_finished_before_a_request_started():
    tok = CharTokenizer()
    first = {"chat": 0, "turn": 0, "messages": [{"role": "user", "content": "abcdefgh"}], "answer": "ijkl",
             "started": 0.0, "finished": 1.0, "prompt_tokens": 9, "cached_tokens": 0}
    same_time = {**first, "chat": 1, "started": 0.5, "finished": 1.5}        # ran alongside: nothing to hit
    later = {"chat": 0, "turn": 1, "answer": "", "started": 2.0, "finished": 3.0, "prompt_tokens": 19,
             "cached_tokens": 12, "messages": first["messages"] + [{"role": "assistant", "content": "ijkl"},
                                                                    {"role": "user", "content": "mnop"}]}
    result = oracle_hit_rate(tok, [later, same_time, first], block=4)
    # "abcdefgh|ijkl" was seen: 12 tokens of later's "abcdefgh|ijkl|mnop|" in full blocks of 4
    assert result["requests"] == [[0, 0, 9, 0, 0], [0, 1, 19, 12, 12], [1, 0, 9, 0, 0]]
    assert result["hit_rate"] == 12 / (9 + 9 + 19) and result["template_length_mismatches"] == 0
    assert result["uncached_tokens_mean"] == (9 + 9 + 19 - 12) / 3   # prompt tokens it computes


def test_a_summary_counts_the_prompt_tokens_each_request_computes():
    from loadtest.bench.fleet import summarise
    records = [{"chat": 0, "turn": t, "error": None, "ttft": 0.1 * (t + 1), "prompt_tokens": 20 * (t + 1),
                "cached_tokens": 16 * t, "completion_tokens": 4} for t in range(3)]
    records.append({**records[0], "turn": 3, "error": "APIError: gone", "prompt_tokens": None})
    summary = summarise(records, seconds=2.0)
    assert summary["errors"] == 1 and summary["hit_rate"] == 48 / 120
    assert summary["uncached_tokens_mean"] == (120 - 48) / 3 and summary["ttft_p50_ms"] == 200.0


def test_chats_resend_their_history_with_capped_lengths():
    tok = CharTokenizer()
    chats = chat_workload(tok, conversations=3, turns=4, seed=0, max_user=50, max_answer=8)
    assert len(chats) == 3 and all(len(c) == 4 for c in chats)
    assert all(answer <= 8 and len(text) <= 60 for chat in chats for text, answer in chat)
    assert chat_workload(tok, 3, 4, 0, 50, 8) == chats          # seeded
