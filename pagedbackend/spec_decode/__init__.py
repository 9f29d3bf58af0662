"""Speculative decoding: its settings (``config``), the proposers (n-gram,
suffix with its index, a draft model) and the speculator that sizes,
proposes and verifies drafts. The engine enters it through its
``Speculator`` (``speculator.make_speculator``).

Nothing is imported here, so that the settings (``config``, imported by
``pagedbackend.config``) load without the rest.
"""
