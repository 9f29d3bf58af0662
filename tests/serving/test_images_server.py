"""Images through real servers, on a text-only model: tritonserver with the
paged_llm model (its ``image`` input, as vllm_backend declares it) and the
OpenAI API in front of it (``image_url`` content parts). An image request
gets a 4xx naming "takes no image input"; on Triton, a bad image (a 20,000 x
20,000 PNG, a corrupt file, a remote URL, too many frames, one image too
many, a fetch too slow) gets a 4xx naming its limit and a full image pool
UNAVAILABLE, while a canary text request keeps streaming. One tritonserver
and one API server for the module."""
import http.server
import threading
import time

import httpx
import numpy as np
import pytest

from client import ServerError, generate, grpc_stream
from image_files import animated_gif, b64, encoded, huge_blank_png, pixels
from triton_images import first_reply
from loadtest.harness.openai import OpenAIServer
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository

pytestmark = pytest.mark.slow

SETTINGS = dict(block_size=16, num_kv_blocks=96, max_num_seqs=64, max_num_batched_tokens=1024,
                dtype="float32", device="cpu", compile=False, MAX_IMAGE_FRAMES="4",
                ALLOWED_MEDIA_DOMAINS="127.0.0.1", IMAGE_FETCH_TIMEOUT="3", IMAGE_WORKERS="1", IMAGE_QUEUE="1")
NO_IMAGES = "this model takes no image input"
GREEDY = {"max_tokens": 4, "temperature": 0.0}


def png_base64(seed: int = 0) -> str:
    return b64(encoded(pixels(seed, 32, 24)))


class _SlowImages(http.server.BaseHTTPRequestHandler):
    """/slow.png: a byte every 0.1 s for 5 s (a fetch of it times out, IMAGE_FETCH_TIMEOUT 3 s)."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        for _ in range(50):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.1)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def slow_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowImages)
    server.handle_error = lambda *args: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def triton(tmp_path_factory, tiny_model_dir):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": tiny_model_dir, **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def api(triton, tiny_model_dir):
    with OpenAIServer(triton.grpc_url, tokenizer=tiny_model_dir) as running:
        yield running


def triton_refusal(triton, images, prompt: str = "Describe the picture.") -> str:
    with pytest.raises(ServerError) as refused:
        generate(prompt, GREEDY, url=triton.grpc_url, images=images, timeout=60)
    return str(refused.value)


def chat_with_images(api, urls, stream: bool = False) -> httpx.Response:
    content = [{"type": "text", "text": "What is in the picture?"}]
    content += [{"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    body = {"model": "paged_llm", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "stream": stream}
    return httpx.post(f"{api.base_url}/chat/completions", json=body, timeout=60)


class Canary:
    """A streamed text request running beside the test: its tokens' arrival times."""

    def __init__(self, triton, tokens: int = 200):
        self.times, self.tokens, self.error = [], 0, None
        params = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        self.thread = threading.Thread(target=self._run, args=(triton, params), daemon=True)

    def _run(self, triton, params):
        try:
            for delta in grpc_stream("Once upon a time", params, url=triton.grpc_url, timeout=120):
                self.times.append(time.perf_counter())
                self.tokens += delta.num_tokens
        except Exception as exc:   # reported by the test
            self.error = exc

    def __enter__(self):
        self.thread.start()
        while not self.times and self.thread.is_alive():   # streaming before the test goes on
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.thread.join(timeout=120)

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


# ---------------------------------------------------------------- Triton's image input

@pytest.mark.timeout(120)
def test_a_valid_image_reaches_the_engine_which_says_the_model_takes_no_image_input(triton):
    message = triton_refusal(triton, [png_base64(1), "data:image/png;base64," + png_base64(2)])

    assert NO_IMAGES in message, message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("images, words", [
    (lambda host: [b64(huge_blank_png(20_000, 20_000))],
     ["image 0", "decompression bomb", "max_image_pixels"]),
    (lambda host: [png_base64(3), b64(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)],
     ["image 1", "corrupt"]),
    (lambda host: ["https://images.example.com/cat.png"], ["image 0", "not in allowed_media_domains"]),
    (lambda host: [b64(animated_gif(6))], ["6 frames", "limit is 4 (max_image_frames)"]),
    (lambda host: [png_base64(4)] * 5, ["5 images", "limit is 4 per prompt", "limit_mm_per_prompt"]),
    (lambda host: [f"{host}/slow.png"], ["not fetched within 3 s", "image_fetch_timeout"]),
], ids=["20000x20000-png", "corrupt", "remote-url", "frames", "one-too-many", "slow-fetch"])
def test_a_bad_image_is_refused_naming_its_limit_while_a_canary_streams(triton, slow_host, images, words):
    with Canary(triton) as canary:
        start = time.perf_counter()
        message = triton_refusal(triton, images(slow_host))
        elapsed = time.perf_counter() - start

    assert all(w in message for w in words), message
    assert NO_IMAGES not in message   # refused before the engine saw it
    assert elapsed < 10.0
    assert canary.error is None and canary.tokens == 200, canary.error
    assert canary.longest_gap() < 3.0


@pytest.mark.timeout(120)
def test_images_with_token_ids_are_refused_by_name(triton):
    import tritonclient.grpc as grpcclient
    ids = grpcclient.InferInput("input_ids", [3], "INT64")
    ids.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int64))
    image = grpcclient.InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(np.array([png_base64(5).encode()], dtype=np.object_))
    _, error = first_reply(triton.grpc_url, [ids, image], 30)

    assert error is not None and "a prompt of token ids takes none" in error.message()


@pytest.mark.timeout(120)
def test_a_full_image_pool_refuses_at_once_and_the_server_keeps_serving(triton, slow_host):
    # One worker and one place in the queue: two slow fetches fill them.
    outcomes = []

    def slow_request():
        try:
            generate("Hi", GREEDY, url=triton.grpc_url, images=[f"{slow_host}/slow.png"], timeout=60)
        except ServerError as exc:
            outcomes.append(str(exc))
    holders = [threading.Thread(target=slow_request) for _ in range(2)]
    for holder in holders:
        holder.start()
        time.sleep(0.3)

    start = time.perf_counter()
    message = triton_refusal(triton, [png_base64(6)])
    elapsed = time.perf_counter() - start
    for holder in holders:
        holder.join(timeout=60)

    assert "busy decoding images" in message and "IMAGE_WORKERS" in message, message
    assert elapsed < 1.5   # refused, not queued behind the fetches
    assert len(outcomes) == 2 and all("image_fetch_timeout" in o for o in outcomes), outcomes
    assert NO_IMAGES in triton_refusal(triton, [png_base64(7)])   # taken again once the pool is free
    assert generate("Hi", GREEDY, url=triton.grpc_url).num_output_tokens == [4]


# ---------------------------------------------------------------- the OpenAI API

@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_image_url_part_to_a_text_model_is_refused_naming_it(api, stream):
    start = time.perf_counter()
    reply = chat_with_images(api, ["data:image/png;base64," + png_base64(8), png_base64(9)], stream)

    assert reply.status_code == 400, reply.text
    assert "model paged_llm takes no image input" in reply.json()["error"]["message"]
    assert time.perf_counter() - start < 5.0


@pytest.mark.timeout(120)
def test_a_reasonable_image_fits_the_body_limit_and_a_too_large_body_gets_413(api):
    url = "data:image/png;base64," + b64(encoded(pixels(10, 1024, 1024)))   # random pixels: ~3 MB of PNG

    fits = chat_with_images(api, [url])
    too_large = chat_with_images(api, ["data:image/png;base64," + "A" * (33 << 20)])

    assert len(url) > 3 << 20
    assert fits.status_code == 400 and "takes no image input" in fits.json()["error"]["message"], fits.text
    assert too_large.status_code == 413 and "larger than the limit" in too_large.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_tokenize_refuses_image_parts_by_name(api):
    body = {"model": "paged_llm", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_base64(11)}}]}]}

    reply = httpx.post(f"{api.url}/tokenize", json=body, timeout=30)

    assert reply.status_code == 400 and "image parts" in reply.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_the_client_cli_sends_image_files(triton, tmp_path):
    import pathlib
    import subprocess
    import sys
    picture = tmp_path / "picture.png"
    picture.write_bytes(encoded(pixels(12)))
    root = pathlib.Path(__file__).resolve().parents[2]

    run = subprocess.run([sys.executable, "-m", "client", "Describe it.", "--url", triton.grpc_url,
                          "--image", str(picture), "--max-tokens", "4"],
                         cwd=root, capture_output=True, text=True, timeout=100)

    assert run.returncode == 1 and NO_IMAGES in run.stderr, run.stderr
