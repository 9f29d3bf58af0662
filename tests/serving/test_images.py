"""Images from requests to PIL images under hard limits (serving/images.py):
each image is made in the test (encoded by Pillow, or written byte by byte
where Pillow would not write it cheaply); URLs are fetched from a real HTTP
server on 127.0.0.1."""
import http.server
import threading
import time

import pytest
from PIL import Image

from image_files import animated_gif, b64, encoded, huge_blank_png, pixels
from pagedbackend.errors import InvalidRequestError
from pagedbackend.multimodal.processor import DEFAULT_IMAGE_LIMIT
from pagedbackend.serving.images import ImageLimits, decode_image, decode_images, images_per_prompt


def refusal(source, limits=ImageLimits()) -> str:
    with pytest.raises(InvalidRequestError) as refused:
        decode_image(source, limits, "image 0")
    assert refused.value.param == "image"
    return str(refused.value)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_each_served_format_decodes_to_the_same_size_in_rgb(fmt):
    image = pixels(1)

    decoded = decode_image(b64(encoded(image, fmt)), ImageLimits())

    assert decoded.mode == "RGB" and decoded.size == image.size
    if fmt in ("PNG", "BMP"):   # lossless: the very pixels
        assert decoded.tobytes() == image.tobytes()


def test_a_data_url_and_bare_base64_give_the_same_pixels_and_line_wrapping_is_accepted():
    data = encoded(pixels(2))
    text = b64(data)
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))

    as_data_url = decode_image(f"data:image/png;base64,{text}", ImageLimits())
    as_base64 = decode_image(text.encode(), ImageLimits())
    as_wrapped = decode_image(wrapped, ImageLimits())

    assert as_data_url.tobytes() == as_base64.tobytes() == as_wrapped.tobytes() == pixels(2).tobytes()


def test_transparency_is_composited_over_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))

    decoded = decode_image(b64(encoded(rgba)), ImageLimits())

    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (255, 255, 255)


def test_a_20000_by_20000_png_is_refused_at_its_header_cheaply():
    bomb = huge_blank_png(20_000, 20_000)
    assert len(bomb) < 200_000   # small on the wire

    start = time.perf_counter()
    message = refusal(b64(bomb))
    elapsed = time.perf_counter() - start

    assert "decompression bomb" in message or "400000000 pixels" in message, message
    assert str(ImageLimits().max_image_pixels) in message
    assert elapsed < 1.0   # 400 million pixels never decoded


def test_an_image_over_the_pixel_limit_but_under_pillows_is_refused_naming_the_limit():
    message = refusal(b64(huge_blank_png(5000, 4000)), ImageLimits(max_image_pixels=10_000_000))

    assert "5000 x 4000 = 20000000 pixels" in message and "limit is 10000000 pixels (max_image_pixels)" in message


def test_bytes_over_the_limit_are_refused_before_base64_is_decoded():
    data = encoded(pixels(3, 64, 64))

    message = refusal(b64(data), ImageLimits(max_image_bytes=1000))

    assert "limit is 1000 bytes" in message and "max_image_bytes" in message


@pytest.mark.parametrize("name, source, words", [
    ("truncated-png", lambda: b64(encoded(pixels(4))[:300]), ["corrupt"]),
    ("flipped-bytes-png", lambda: b64(encoded(pixels(4))[:100] + b"\xff" * 200 + encoded(pixels(4))[300:]),
     ["corrupt"]),
    ("truncated-jpeg", lambda: b64(encoded(pixels(4, 200, 200), "JPEG")[:600]), ["corrupt"]),
    ("not-an-image", lambda: b64(b"hello, this is text and no picture at all"), ["not an image", "PNG, JPEG"]),
    ("tiff", lambda: b64(encoded(pixels(4), "TIFF")), ["not an image in a served format"]),
    ("not-base64", lambda: "this is *not* base64!", ["not valid base64"]),
    ("empty", lambda: "", ["empty"]),
    ("non-ascii", lambda: "héllo", ["non-ASCII"]),
    ("text-data-url", lambda: "data:text/plain;base64,aGVsbG8=", ["text/plain", "not an image"]),
    ("data-url-without-base64", lambda: "data:image/png,abcd", ["without ;base64"]),
    ("file-url", lambda: "file:///etc/passwd", ["file: URL"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_sources_are_refused_naming_the_problem(name, source, words):
    message = refusal(source())

    assert message.startswith("image 0") and all(w in message for w in words), message


def test_an_animated_gif_over_the_frame_limit_is_refused_and_one_within_serves_its_first_frame():
    gif = animated_gif(10)

    message = refusal(b64(gif), ImageLimits(max_image_frames=4))
    first = decode_image(b64(gif), ImageLimits(max_image_frames=10))

    assert "10 frames" in message and "limit is 4 (max_image_frames)" in message
    assert first.getpixel((0, 0)) == (0, 0, 0)


def test_an_animated_png_over_the_frame_limit_is_refused():
    frames = [Image.new("RGB", (8, 8), (0, i * 20, 0)) for i in range(5)]
    apng = encoded(frames[0], "PNG", save_all=True, append_images=frames[1:])

    assert "5 frames" in refusal(b64(apng), ImageLimits(max_image_frames=2))


def test_decode_images_names_the_bad_one_by_position():
    good = b64(encoded(pixels(5)))

    with pytest.raises(InvalidRequestError) as refused:
        decode_images([good, good, "!!"], ImageLimits())

    assert str(refused.value).startswith("image 2 ")


class _Images(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        if self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):   # a byte every 0.1 s: each read is quick, the whole is not
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/picture.png")
            self.end_headers()
            return
        self.send_response(200 if self.path == "/picture.png" else 404)
        self.end_headers()
        self.wfile.write(self.body if self.path == "/picture.png" else b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.body = encoded(pixels(6))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.handle_error = lambda *args: None   # the slow reply's client hangs up: expected
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_urls_are_refused_by_default_without_any_connection(image_host):
    message = refusal(f"{image_host}/picture.png")

    assert "fetches no URLs (allowed_media_domains is empty)" in message


def test_a_url_of_a_host_not_listed_is_refused(image_host):
    message = refusal(f"{image_host}/picture.png", ImageLimits(allowed_media_domains=("images.example.com",)))

    assert "host '127.0.0.1'" in message and "not in allowed_media_domains" in message


def test_an_allowed_host_is_fetched(image_host):
    limits = ImageLimits.from_settings({"ALLOWED_MEDIA_DOMAINS": "127.0.0.1, images.example.com"})

    image = decode_image(f"{image_host}/picture.png", limits)

    assert image.tobytes() == pixels(6).tobytes()


@pytest.mark.parametrize("path, limits, words", [
    ("/missing.png", {}, ["HTTP 404"]),
    ("/moved.png", {}, ["HTTP 302"]),   # redirects are not followed
    ("/picture.png", {"max_image_bytes": 100}, ["limit per image", "max_image_bytes"]),
    ("/slow.png", {"image_fetch_timeout": 1.0}, ["within 1 s", "image_fetch_timeout"]),
], ids=["missing", "redirect", "too-large", "too-slow"])
def test_a_fetch_is_bounded_and_its_failures_refused(image_host, path, limits, words):
    start = time.perf_counter()
    message = refusal(f"{image_host}{path}", ImageLimits(allowed_media_domains=("127.0.0.1",), **limits))

    assert all(w in message for w in words), message
    assert time.perf_counter() - start < 2.5


def test_settings_are_read_by_name_and_bad_ones_refused():
    limits = ImageLimits.from_settings({"MAX_IMAGE_PIXELS": "1000000", "allowed_media_domains": '["A.example"]'})

    assert limits.max_image_pixels == 1_000_000 and limits.allowed_media_domains == ("a.example",)
    with pytest.raises(ValueError, match="unknown image limit"):
        ImageLimits.from_settings({"max_pixels": "1"})
    with pytest.raises(ValueError, match="decompression-bomb"):
        ImageLimits(max_image_pixels=10 ** 10)


def test_images_per_prompt_follows_the_engines_limit_mm_per_prompt_and_its_default():
    class Config:
        limit_mm_per_prompt = '{"image": 3}'

    class Unset:
        limit_mm_per_prompt = None

    assert images_per_prompt(Config()) == 3
    assert images_per_prompt(Unset()) == DEFAULT_IMAGE_LIMIT == 4
