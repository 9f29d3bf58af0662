"""Images in prompts: what a request with images becomes before the engine
computes it.

A prompt with images is vLLM's dict, ``{"prompt": text, "multi_modal_data":
{"image": [PIL images]}}``. The model folder's own processor (transformers'
``AutoProcessor``: resize, split, placeholder expansion) turns it into token
ids in which every image stands as a span of placeholder tokens, and the
per-image tensors its vision tower takes (``inputs.MultiModalItem``). The
engine computes an image's embeddings once (its vision tower and projector,
``models.vision``), keeps them by content hash in the encoder cache, and puts
them in place of the placeholder embeddings in the prefill chunks that cover
the span. Block hashes of the prefix cache include the hashes of the images
inside a block, so the same text with another image never shares blocks.
"""
