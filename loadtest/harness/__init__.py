"""Servers started for tests and benchmarks (outside the product package):
``triton`` (a tritonserver on free loopback ports), ``openai`` (the
OpenAI-compatible API in front of one) and ``fleet`` (``make fleet``'s
processes)."""
