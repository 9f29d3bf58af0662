"""The Dynamo worker of a fleet: ``python -m pagedbackend.serving.dynamo``
fronts one replica (a tritonserver serving our model) for NVIDIA Dynamo's
frontend and KV-aware router (docs/fleet.md). Imports Dynamo only in
``worker``; ``requests`` and ``replica`` are Dynamo-free."""
