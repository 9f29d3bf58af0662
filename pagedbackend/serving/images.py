"""Images from requests to PIL images, under hard limits.

An image arrives as text: base64 (vllm_backend's ``image`` tensor), a
``data:image/...;base64,`` URL (OpenAI's ``image_url``), or an ``http(s)://``
URL, fetched only from the hosts that ``allowed_media_domains`` lists (none by
default: the server fetches nothing unless told to). Every step is bounded
before it runs: the encoded bytes before base64 is decoded or a download read
on; the width x height from the file's header before any pixel is decoded (a
20,000 x 20,000 PNG of a few hundred kilobytes is refused at its header); the
frames of an animated GIF, WebP or APNG; the formats Pillow may try. The
image served is the first frame, in RGB (transparency over white, as
transformers' image processors do). Every refusal is an
``InvalidRequestError`` naming the problem and the limit.
"""
import base64
import binascii
import dataclasses
import http.client
import io
import json
import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from pagedbackend.config import coerce
from pagedbackend.errors import InvalidRequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")   # Pillow's names of the formats served
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,15}:")   # base64 has no ':', a URL has one early
_WHITESPACE = re.compile(rb"\s+")
MAX_URL_CHARS = 4096
SHOWN_URL_CHARS = 120   # of a URL quoted in an error


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be. The Triton model reads each from the
    config.pbtxt parameter of its name in upper case (``MAX_IMAGE_PIXELS``,
    ``ALLOWED_MEDIA_DOMAINS``); vLLM's name where vLLM has the setting."""
    # Encoded bytes of one image (after base64), checked before decoding it;
    # OpenAI's own limit is 20 MB an image.
    max_image_bytes: int = 20 << 20
    # Width x height, read from the header before any pixel is decoded: 8K UHD
    # (7680 x 4320) and any photo of up to 33 megapixels; RGB pixels take 3
    # bytes each once decoded. At most Pillow's own decompression-bomb limit.
    max_image_pixels: int = 7680 * 4320
    # Frames of an animated GIF, WebP or APNG (the first one is served).
    max_image_frames: int = 64
    # Hosts whose http(s) image URLs the server fetches (vLLM's name); empty:
    # none, so that a request cannot make the server reach any address.
    allowed_media_domains: Tuple[str, ...] = ()
    # Seconds a fetch may take, connection to last byte (vLLM's
    # VLLM_IMAGE_FETCH_TIMEOUT); its bytes are bounded by max_image_bytes.
    image_fetch_timeout: float = 5.0

    def __post_init__(self):
        from PIL import Image
        for name in ("max_image_bytes", "max_image_pixels", "max_image_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"image limit {name} must be a positive integer, got {value!r}")
        bomb = Image.MAX_IMAGE_PIXELS and 2 * Image.MAX_IMAGE_PIXELS
        if bomb and self.max_image_pixels > bomb:
            raise ValueError(f"image limit max_image_pixels ({self.max_image_pixels}) is above Pillow's "
                             f"decompression-bomb limit ({bomb}), which would refuse such images first")
        if not self.image_fetch_timeout > 0:
            raise ValueError(f"image limit image_fetch_timeout must be positive, got {self.image_fetch_timeout!r}")
        domains = tuple(d.strip().lower() for d in self.allowed_media_domains if d.strip())
        object.__setattr__(self, "allowed_media_domains", domains)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> "ImageLimits":
        """From ``{name: text}`` (names case-insensitive; the domains as a
        JSON list or comma-separated); an unknown name is refused, naming it."""
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        given = {}
        for name, value in values.items():
            key = name.lower()
            if key not in hints:
                raise ValueError(f"unknown image limit {name!r}; the limits are {', '.join(sorted(hints))}")
            if key == "allowed_media_domains":
                given[key] = _domains(value)
            else:
                given[key] = coerce(f"image limit {name}", hints[key], value)
        return cls(**given)


def _domains(value) -> Tuple[str, ...]:
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, str) for d in value):
        raise ValueError(f"image limit allowed_media_domains must be a list of host names, got {value!r}")
    return tuple(value)


def refuse(message: str):
    raise InvalidRequestError(message, param="image")


def decode_images(sources: Sequence, limits: ImageLimits) -> List[object]:
    """Every source (text or bytes: base64, a data URL, an allowed http(s)
    URL) as an RGB PIL image, in order; the first bad one is refused, named
    by its position."""
    return [decode_image(source, limits, f"image {i}") for i, source in enumerate(sources)]


def decode_image(source, limits: ImageLimits, where: str = "image"):
    """One source as an RGB PIL image (its first frame), checked against ``limits``."""
    return open_image(image_bytes(source, limits, where), limits, where)


def image_bytes(source, limits: ImageLimits, where: str = "image") -> bytes:
    """The encoded image a source holds: base64 decoded, a data URL's
    payload, or an allowed URL's body; nothing is decoded or fetched beyond
    ``max_image_bytes``."""
    if isinstance(source, str):
        try:
            source = source.encode("ascii")
        except UnicodeEncodeError:
            refuse(f"{where} is neither base64 nor a data: or http(s) URL (it holds non-ASCII characters)")
    if not isinstance(source, (bytes, bytearray)):
        refuse(f"{where} must be a string (base64 or a URL), got {type(source).__name__}")
    source = bytes(source).strip()
    if not source:
        refuse(f"{where} is empty")
    scheme = _SCHEME.match(source[:20].decode("ascii"))
    if scheme is None:
        return _base64(source, limits, where)
    scheme = scheme.group(0)[:-1].lower()
    if scheme == "data":
        return _data_url(source, limits, where)
    if scheme in ("http", "https"):
        return fetch_image(source.decode("ascii"), limits, where)
    refuse(f"{where} is a {scheme}: URL; images come as base64, data:image/...;base64 URLs, or http(s) "
           "URLs of the hosts in allowed_media_domains")


def _base64(text: bytes, limits: ImageLimits, where: str) -> bytes:
    if _WHITESPACE.search(text):   # line-wrapped base64 (MIME)
        text = _WHITESPACE.sub(b"", text)
    size = len(text) * 3 // 4   # decoded size, known before decoding
    if size > limits.max_image_bytes + 2:
        refuse(f"{where} has about {size} bytes; the limit is {limits.max_image_bytes} bytes per image "
               "(max_image_bytes)")
    try:
        data = base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        refuse(f"{where} is not valid base64 ({exc})")
    if len(data) > limits.max_image_bytes:
        refuse(f"{where} has {len(data)} bytes; the limit is {limits.max_image_bytes} bytes per image "
               "(max_image_bytes)")
    return data


def _data_url(url: bytes, limits: ImageLimits, where: str) -> bytes:
    header, comma, payload = url[5:].partition(b",")
    if not comma:
        refuse(f"{where} is a data URL without a comma before its data")
    parts = header.decode("ascii").lower().split(";")
    media_type = parts[0].strip()
    if media_type and not media_type.startswith("image/"):
        refuse(f"{where} is a data URL of type {media_type!r}, not an image")
    if "base64" not in (p.strip() for p in parts[1:]):
        refuse(f"{where} is a data URL without ;base64 (images come base64-encoded)")
    return _base64(payload, limits, where)


def fetch_image(url: str, limits: ImageLimits, where: str = "image") -> bytes:
    """The body of an http(s) URL whose host ``allowed_media_domains`` lists:
    at most ``max_image_bytes``, within ``image_fetch_timeout`` seconds, with
    no redirects and no proxies."""
    shown = url if len(url) <= SHOWN_URL_CHARS else url[:SHOWN_URL_CHARS] + "..."
    if not limits.allowed_media_domains:
        refuse(f"{where} is a URL ({shown}); this server fetches no URLs (allowed_media_domains is empty): "
               "send the image as base64 or a data:image/...;base64 URL")
    if len(url) > MAX_URL_CHARS:
        refuse(f"{where} is a URL of {len(url)} characters; the limit is {MAX_URL_CHARS}")
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError as exc:
        refuse(f"{where} is not a valid URL ({exc})")
    if host not in limits.allowed_media_domains:
        refuse(f"{where}: host {host!r} of {shown} is not in allowed_media_domains "
               f"({', '.join(limits.allowed_media_domains)})")
    timeout = limits.image_fetch_timeout
    deadline = time.monotonic() + timeout
    kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    connection = kind(host, port, timeout=timeout)
    try:
        connection.connect()
        sock = connection.sock   # kept: a reply that closes the connection leaves it to the reply
        connection.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                           headers={"Accept": "image/*", "User-Agent": "pagedbackend"})
        reply = connection.getresponse()
        if reply.status != 200:
            refuse(f"{where}: {shown} answered HTTP {reply.status} {reply.reason}")
        declared = reply.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > limits.max_image_bytes:
            refuse(f"{where}: {shown} has {declared} bytes; the limit is {limits.max_image_bytes} bytes a "
                   "image (max_image_bytes)")
        chunks, size = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
            chunk = reply.read1(64 << 10)
            if not chunk:
                break
            size += len(chunk)
            if size > limits.max_image_bytes:
                refuse(f"{where}: {shown} sent more than {limits.max_image_bytes} bytes, the limit per "
                       "image (max_image_bytes)")
            chunks.append(chunk)
        return b"".join(chunks)
    except TimeoutError:
        refuse(f"{where}: {shown} was not fetched within {timeout:g} s (image_fetch_timeout)")
    except (OSError, http.client.HTTPException) as exc:
        refuse(f"{where}: {shown} could not be fetched ({type(exc).__name__}: {exc})")
    finally:
        connection.close()


def open_image(data: bytes, limits: ImageLimits, where: str = "image"):
    """Encoded bytes as an RGB PIL image: format, size and frames read from
    the header and checked before the first frame's pixels are decoded."""
    from PIL import Image, UnidentifiedImageError
    if len(data) > limits.max_image_bytes:
        refuse(f"{where} has {len(data)} bytes; the limit is {limits.max_image_bytes} bytes per image "
               "(max_image_bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        refuse(f"{where} is refused as a decompression bomb ({exc}); the limit is "
               f"{limits.max_image_pixels} pixels (max_image_pixels)")
    except UnidentifiedImageError:
        refuse(f"{where} is not an image in a served format ({', '.join(FORMATS)}), or its header is corrupt")
    except Exception as exc:   # a header Pillow cannot parse
        refuse(f"{where} is corrupt ({type(exc).__name__}: {exc})")
    width, height = image.size
    if width * height > limits.max_image_pixels:
        refuse(f"{where} is {width} x {height} = {width * height} pixels; the limit is "
               f"{limits.max_image_pixels} pixels (max_image_pixels)")
    if width < 1 or height < 1:
        refuse(f"{where} is {width} x {height} pixels: empty")
    try:
        frames = getattr(image, "n_frames", 1)   # GIF: block sizes scanned, no pixel decoded
        if frames > limits.max_image_frames:
            refuse(f"{where} has {frames} frames; the limit is {limits.max_image_frames} (max_image_frames)")
        if frames > 1:
            image.seek(0)
        image.load()
    except InvalidRequestError:
        raise
    except Exception as exc:   # truncated data, bad checksums, broken compressed streams
        refuse(f"{where} is corrupt or truncated ({type(exc).__name__}: {exc})")
    return to_rgb(image)


def to_rgb(image):
    """An RGB copy of a decoded image; transparent pixels over white (as
    transformers' ``convert_to_rgb`` and vLLM do)."""
    from PIL import Image
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def images_per_prompt(engine_config) -> int:
    """The most images a prompt may carry: the engine's ``limit_mm_per_prompt``
    (vLLM's setting, ``{"image": count}``, as JSON or a mapping), else the
    engine's own default."""
    from pagedbackend.multimodal.processor import DEFAULT_IMAGE_LIMIT
    value = getattr(engine_config, "limit_mm_per_prompt", None)
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    if isinstance(value, Mapping):
        value = value.get("image")
    return DEFAULT_IMAGE_LIMIT if value is None else int(value)
