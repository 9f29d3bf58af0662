"""Serving: ``triton/`` runs inside Triton's Python backend stub for
``model.py``; ``openai/`` is the OpenAI-compatible API in front of tritonserver;
``repository``, ``process``, ``readiness`` and ``launcher`` prepare, run, probe
and command tritonserver (the servers that tests and benchmarks start are in
loadtest/harness/); ``constants`` holds the names they share."""
