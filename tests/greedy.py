"""Greedy token ids of the default model under some engine settings, for
tests that compare one setting's tokens with another's."""
from typing import List, Sequence


def default_model_greedy(prompts: Sequence[str], max_tokens: int, **settings) -> List[List[int]]:
    """Each prompt's greedy tokens (EOS ignored), eager, 64 KV blocks, plus ``settings``."""
    from pagedbackend import LLM, SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model="default", compile=False, num_kv_blocks=64, **settings) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(list(prompts), params)]
