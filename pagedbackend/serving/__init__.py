"""Serving: the tritonserver launcher (``launcher``) and the helpers that
``model_repository/paged_llm/1/model.py`` uses inside Triton's Python backend
(``triton_io``: inputs and responses, ``metrics``: metric families)."""
