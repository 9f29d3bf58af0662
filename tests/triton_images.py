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
    results = []
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        client.async_stream_infer("paged_llm", inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + 120
        while not results and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        client.stop_stream()
        client.close()
    result, error = results[0]
    assert error is None, error
    ids = [t for t in result.as_numpy("output_ids").reshape(-1).tolist() if t >= 0]
    return ids, int(result.as_numpy("num_input_tokens")[0])
