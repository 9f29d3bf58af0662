"""Structured outputs: a request's constraint (``params``), its grammar
compiled by xgrammar (``compiler``), the grammar workers that advance each
sequence's matcher and fill its next mask (``grammar_worker``), and the
queue of requests whose grammar still compiles (``queue``). The engine
enters it through ``StructuredQueue``.

Nothing is imported here, so that the parameters (``params``, imported by
``pagedbackend.sampling_params``) load without the rest.
"""
