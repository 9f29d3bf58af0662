"""Vision towers and projectors of vision-language families: an image's
processor tensors in, its embedding rows (the text model's hidden size) out.

Every family's encoder is a ``base.VisionEncoder``; the family's causal model
(``models/<family>.py``) holds one as ``.vision`` and names its placeholder
token (``image_token_id``)."""
