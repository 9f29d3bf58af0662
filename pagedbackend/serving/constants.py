"""Names that the serving pieces (the Triton model, the launcher, the OpenAI
API) must agree on, kept in one place so that they cannot drift apart."""

# The model folder of model_repository/, hence Triton's name for our model.
SERVED_MODEL = "paged_llm"

# tritonserver's model repository API (load, unload, index) answers only
# requests carrying this header with the server's key.
ADMIN_HEADER = "pagedbackend-admin-key"
# tritonserver expects the restricted gRPC protocol's key header with this prefix.
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
# The key, shared with the OpenAI-compatible server that lists the repository's models.
ADMIN_KEY_ENV = "PAGEDBACKEND_ADMIN_KEY"

# Seconds tritonserver has, after SIGTERM, for HTTP connections to close,
# requests to end and the model to unload (the model ends its own requests at
# once; idle keep-alive clients are what it waits for). The unload alone takes
# over a second (the Python backend's health check sleeps one second before it
# asks the stub to finalize) and an open HTTP connection costs a second more;
# 5 s ran out on a loaded 2-core machine, so 10.
EXIT_TIMEOUT_S = 10

# The error that ends every open request when a server stops.
SHUTTING_DOWN = "the server is shutting down"

# How the Triton model's refusal of a request begins when its image workers
# are all busy (the OpenAI API answers it with 503, as a server too busy).
IMAGES_BUSY = "the server is busy decoding images"
