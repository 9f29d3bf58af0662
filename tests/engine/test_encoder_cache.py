"""The encoder cache: image embeddings by content hash, bounded in bytes, LRU."""
import torch

from loadtest.tiny_vision import random_image
from pagedbackend.multimodal.encoder_cache import EncoderCache
from pagedbackend.multimodal.inputs import MultiModalItem, block_keys, image_hash


def test_lru_within_the_byte_budget():
    rows = lambda: torch.zeros(4, 8)   # 128 bytes  # noqa: E731
    cache = EncoderCache(300)
    cache.put("a", rows())
    cache.put("b", rows())
    assert cache.get("a") is not None   # a is now the most recent
    cache.put("c", rows())               # b goes: 3 x 128 > 300
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 256 and len(cache) == 2
    cache.put("huge", torch.zeros(100, 8))   # larger than the budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 2)


def test_image_hash_is_of_the_pixels():
    a, b = random_image(0), random_image(1)
    assert image_hash(a) == image_hash(random_image(0)) != image_hash(b)
    assert image_hash(a) != image_hash(a.convert("L"))
    # The same pixels through PNG bytes and back hash alike.
    import io
    from PIL import Image
    buffer = io.BytesIO()
    a.save(buffer, format="PNG")
    assert image_hash(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")) == image_hash(a)


def test_block_keys_mark_the_block_where_each_image_starts():
    def item(digest, offset):
        return MultiModalItem("image", digest, offset, 16, None, {})
    keys = block_keys([item("aa" * 32, 3), item("bb" * 32, 21), item("cc" * 32, 30)], block_size=16)
    assert keys == {0: bytes.fromhex("aa" * 32), 1: bytes.fromhex("bb" * 32) + bytes.fromhex("cc" * 32)}
