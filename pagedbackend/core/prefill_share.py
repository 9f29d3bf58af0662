"""Prefill chunks sized by time. While sequences decode, or requests wait to
be admitted, a long prompt beside them is computed in chunks small enough
that a step stays near a time-per-output-token target
(``EngineConfig.tpot_target_s``): every running stream gets a token about
that often, and a newcomer's first step is short. With nothing decoding and
nobody waiting, chunks grow back to ``long_prefill_token_threshold`` (0: the
whole token budget), which computes a prompt fastest.

The step's cost is modelled as ``seconds = a + b * tokens`` (a: the weights
read once per step and the per-step overhead; b: per token), fitted by least
squares over the measured steps, recent ones weighing most. The prefill
share of a step is what the target leaves after its decode tokens,
``(target - a) / b - decode_tokens`` (with nothing decoding, at least the
configured chunk: nobody's pace is at stake), given to the prompts that are
prefilling or waiting shortest remainder first (under the priority policy,
higher priority first, then shortest), each at least MIN_CHUNK (so
every prompt advances) and at most the configured chunk; a prompt whose
whole rest fits a step of FINISH_TARGETS targets is finished in this step.
Shortest first, and finishing short prompts, give the least mean time to
first token: requests that arrive together (closed-loop clients finish and
return together) get their first tokens one after another instead of all at
the end of an evenly shared prefill held to the decodes' pace, and a short
prompt beside a long one is through in one step.

The target holds on average, not step by step: a step that carries decode
tokens and finishes under the target banks the time it left (at most
CREDIT_TARGETS targets' worth), and the next prefill may spend it. Decode
steps of a few streams are well under the target, so a newcomer's short
prompt beside them is computed in one step (its time to first token is one
step, not a handful of small chunks), while a long prompt spends the credit
on its first chunk and then keeps to the target.

The trade-off: a long prompt's time to first token grows while others
decode (its chunks shrink), by about the ratio of the full chunk's step time
to the target; the streams beside it keep
their pace instead of slowing to one token per full-chunk step.
"""
from typing import Dict, List, Optional, Tuple

MIN_CHUNK = 16       # prompt tokens a prefilling sequence computes per step at least
FORGET = 0.9         # weight of the earlier steps in the fit, per step
MIN_STEPS = 3        # steps measured before chunks are sized by time
FINISH_TARGETS = 4.0  # a step may take this many targets to finish prompts whose rest fits it
CREDIT_TARGETS = 2.0  # time left under the target that later steps may spend, in targets at most


class PrefillShare:
    def __init__(self, target_s: float, max_chunk: int):
        self.target_s, self.max_chunk = target_s, max_chunk
        # Weighted sums for the fit: weight, tokens, seconds, tokens^2, tokens*seconds.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.steps = 0
        self.credit = 0.0   # seconds banked by steps under the target
        self._paced = False  # whether the step being observed kept pace for someone

    def observe(self, tokens: int, seconds: float) -> None:
        """One step that ran the model: ``tokens`` computed in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._paced:   # a step sized for the target: bank what it left, pay what it overran
            self.credit = min(CREDIT_TARGETS * self.target_s, max(0.0, self.credit + self.target_s - seconds))
        f = FORGET
        self._w, self._x, self._y = f * self._w + 1, f * self._x + tokens, f * self._y + seconds
        self._xx, self._xy = f * self._xx + tokens * tokens, f * self._xy + tokens * seconds
        self.steps += 1

    def cost(self):
        """``(a, b)``: seconds per step and per token of the fit (b > 0, a >= 0);
        with steps of one size alone, all of the cost is put on the tokens."""
        spread = self._w * self._xx - self._x * self._x
        b = (self._w * self._xy - self._x * self._y) / spread if spread > 1e-6 * self._xx * self._w else 0.0
        a = (self._y - b * self._x) / self._w
        if b <= 0 or a < 0:
            return 0.0, self._y / self._x
        return a, b

    def share(self, decode_tokens: int, targets: float = 1.0) -> int:
        """Prompt tokens the next step may compute beside ``decode_tokens`` in
        ``targets`` times the target."""
        a, b = self.cost()
        share = int(round((targets * self.target_s + self.credit - a) / b - decode_tokens, 6))
        return share if decode_tokens else max(share, self.max_chunk)

    def caps(self, decode_tokens: int, prompts: List[Tuple], waiting: int) -> Optional[Dict[int, int]]:
        """The most prompt tokens each sequence computes in the next step, by
        sequence id, for ``prompts`` (sequence id, prompt tokens left[, rank:
        lower first]) of the sequences prefilling and the first waiting ones,
        in scheduling order;
        None (the configured chunk) when nothing decodes and nobody waits
        (``waiting`` requests) or too few steps were measured."""
        self._paced = decode_tokens > 0 or waiting > 0
        if not self._paced or self.steps < MIN_STEPS:
            return None
        left, finish, caps = self.share(decode_tokens), self.share(decode_tokens, FINISH_TARGETS), {}
        for seq_id, tokens, *_ in sorted(prompts, key=lambda p: (p[2:], p[1])):   # stable: ties in order
            if tokens <= min(self.max_chunk, finish):   # its whole rest fits: first token this step
                cap = tokens
            else:
                cap = max(MIN_CHUNK, min(self.max_chunk, tokens, left))
            caps[seq_id] = cap
            left, finish = left - min(cap, tokens), finish - min(cap, tokens)
        return caps

    def caps_for(self, scheduler) -> Optional[Dict[int, int]]:
        """``caps`` for the scheduler's queues as they stand before a step (the
        waiting requests that could be admitted: at most ``max_num_seqs``)."""
        decode, prompts = 0, []
        rank = (lambda group: group.priority) if scheduler.priority else (lambda group: 0)
        for group in scheduler.running:
            for seq in group.seqs:
                if seq.num_uncomputed_tokens > 1:
                    prompts.append((seq.seq_id, seq.num_uncomputed_tokens, rank(group)))
                else:
                    decode += 1 + scheduler.num_lookahead
        for group in scheduler.waiting.first(scheduler.config.max_num_seqs):
            prompts += [(seq.seq_id, seq.num_uncomputed_tokens, rank(group)) for seq in group.seqs]
        return self.caps(decode, prompts, len(scheduler.waiting))
