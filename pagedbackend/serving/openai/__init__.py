"""The OpenAI-compatible API in front of tritonserver: ``app`` (FastAPI app,
routes), ``generations`` (a request run on Triton and answered), ``answers``
(stream chunks and answer objects), ``asgi`` (body limit, errors, event
stream), ``triton_client`` (gRPC streams to the model, cancellation),
``protocol`` (request schemas, errors, logprobs mapping), ``structured``
(response formats, tools), ``cli`` (the command line); the child process
that tests start is ``loadtest.harness.openai``."""
