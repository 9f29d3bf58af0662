"""Images through Triton's ``image`` tensor in the vision server tests:
the engine settings of their model repositories and one greedy request."""
import json
import time

import numpy as np

SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False)
MAX_TOKENS = 8


def triton_tokens(triton, text: str, images) -> tuple:
    """One non-streamed request: (new token ids, num_input_tokens)."""
    import tritonclient.grpc as grpcclient
    values = {"text_input": np.array([text.encode()], dtype=np.object_),
              "image": np.array([i.encode() for i in images], dtype=np.object_),
              "sampling_parameters": np.array([json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                           "ignore_eos": True}).encode()], dtype=np.object_),
              "exclude_input_in_output": np.array([True]), "return_output_ids": np.array([True]),
              "return_num_input_tokens": np.array([True])}
    inputs = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == np.object_ else "BOOL")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result, error = first_reply(triton.grpc_url, inputs, 120, enable_empty_final_response=True)
    assert error is None, error
    ids = [t for t in result.as_numpy("output_ids").reshape(-1).tolist() if t >= 0]
    return ids, int(result.as_numpy("num_input_tokens")[0])


def first_reply(grpc_url: str, inputs, timeout_s: float, **options) -> tuple:
    """``(result, error)`` of the first reply on a gRPC stream to ``paged_llm``
    (``(None, None)`` when none comes within ``timeout_s``)."""
    import tritonclient.grpc as grpcclient
    replies = []
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: replies.append((result, error)))
    try:
        client.async_stream_infer("paged_llm", inputs, **options)
        deadline = time.monotonic() + timeout_s
        while not replies and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        client.stop_stream()
        client.close()
    return replies[0] if replies else (None, None)
