"""Serving: ``triton/`` runs inside Triton's Python backend stub for
``model.py``; ``openai/`` is the OpenAI-compatible API in front of tritonserver;
``repository``, ``process``, ``harness`` and ``launcher`` prepare, run, test
and command tritonserver; ``constants`` holds the names they share."""
