"""Greedy decoding straight through a ModelRunner (paged, shuffled block
tables) and through Hugging Face ``generate``, for tests that compare them."""
import random

import torch

from pagedbackend.worker.model_runner import SeqEntry

MAX_NEW_TOKENS = 16


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def shuffled_block_tables(runner, lengths, seed=0):
    """Distinct physical blocks in random order, enough for each length."""
    need = [-(-n // runner.block_size) for n in lengths]
    physical = random.Random(seed).sample(range(runner.num_kv_blocks), sum(need))
    starts = [sum(need[:i]) for i in range(len(need))]
    return [physical[s:s + n] for s, n in zip(starts, need)]


def eos_ids(runner):
    from pagedbackend.engine.tokenizer import eos_token_ids, load_tokenizer
    return eos_token_ids(runner.model_path, load_tokenizer(runner.model_path))


def greedy_paged(runner, prompts, max_new_tokens=MAX_NEW_TOKENS):
    """Greedy decoding through the runner. Every other prompt starts one step
    late, so step 2 mixes prefills with decodes; a sequence stops at EOS. A
    model with several KV groups gets a block table per group and sequence."""
    # One table per KV group (distinct blocks each: a group's layers fill the slots of its own blocks).
    groups = len(runner.kv_layout.groups)
    lengths = [len(p) + max_new_tokens for p in prompts]
    group_tables = shuffled_block_tables(runner, lengths * groups)
    tables = group_tables[:len(prompts)]
    per_seq = [group_tables[i::len(prompts)] if groups > 1 else None for i in range(len(prompts))]
    eos = eos_ids(runner)
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    outputs = [[] for _ in prompts]
    step = 0

    def running(i):
        done = len(outputs[i]) == max_new_tokens or (outputs[i] and outputs[i][-1] in eos)
        return not done and (i % 2 == 0 or step > 0)

    while any(running(i) for i in range(len(prompts))):
        active = [i for i in range(len(prompts)) if running(i)]
        entries = [SeqEntry(tokens[i][cached[i]:], cached[i], tables[i], True, block_tables=per_seq[i])
                   for i in active]
        logits = runner.execute_model(entries)
        assert logits.shape == (len(active), runner.vocab_size) and logits.dtype == torch.float32
        for i, row in zip(active, logits):
            cached[i] = len(tokens[i])
            tokens[i].append(int(row.argmax()))
            outputs[i].append(tokens[i][-1])
        step += 1
    return outputs


def greedy_hf(hf, prompts, max_new_tokens=MAX_NEW_TOKENS):
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
