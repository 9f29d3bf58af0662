"""Content versions of KV slots, for isolation tests: every slot written
by a step is tagged with the writer's cache salt and the tokens its K/V were
computed from (speculative ones included); copies and swaps move the tags
with the blocks; before each step every sequence must find its own tag in
every slot it reads."""
import hashlib

from pagedbackend.worker.model_runner import ModelRunner


def prefix_tags(salt: bytes, token_ids):
    """Tag of position p: the salt and tokens[:p + 1] (what K/V at p depend on)."""
    tags, digest = [], hashlib.sha256(b"salt:" + salt).digest()
    for token in token_ids:
        digest = hashlib.sha256(digest + token.to_bytes(8, "little")).digest()
        tags.append(digest)
    return tags


class TaggingRunner:
    """A real ModelRunner whose KV slots carry content versions."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.device_tags, self.host_tags = {}, {}
        self.reads_checked = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute_model(self, entries):
        bs = self.runner.block_size
        for item in entries:
            # What the K/V of this entry are computed from: the verified tokens,
            # then its speculative ones (which may be rejected afterwards).
            computed = item.seq.token_ids[:item.start_pos + item.num_new_tokens] + list(item.draft_token_ids)
            tags = prefix_tags(item.group.cache_salt, computed)
            for p in range(item.start_pos):
                slot = item.block_table[p // bs] * bs + p % bs
                assert self.device_tags.get(slot) == tags[p], (
                    f"request {item.group.request_id} reads position {p} (slot {slot}) that holds K/V "
                    "it did not compute: another request's, or stale")
                self.reads_checked += 1
            for p in range(item.start_pos, item.start_pos + len(item.token_ids)):
                self.device_tags[item.block_table[p // bs] * bs + p % bs] = tags[p]
        return self.runner.execute_model(entries)

    def _move(self, pairs, source, target):
        bs = self.runner.block_size
        for src, dst in pairs:
            for i in range(bs):
                if src * bs + i in source:
                    target[dst * bs + i] = source[src * bs + i]
                else:
                    target.pop(dst * bs + i, None)

    def copy_blocks(self, pairs):
        self._move(pairs, self.device_tags, self.device_tags)
        self.runner.copy_blocks(pairs)

    def swap_out(self, pairs):
        self._move(pairs, self.device_tags, self.host_tags)
        self.runner.swap_out(pairs)

    def swap_in(self, pairs):
        self._move(pairs, self.host_tags, self.device_tags)
        self.runner.swap_in(pairs)
