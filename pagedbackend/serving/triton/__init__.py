"""What runs inside Triton's Python backend stub for ``model_repository/paged_llm/1/model.py``:
``io`` (inputs, limits, responses), ``metrics`` (metric families), ``lifecycle``
(the stub lives and dies with tritonserver, drains on SIGTERM), ``health``
(engine failure -> model unloaded), ``image_pool`` (the threads that take
requests with images)."""
