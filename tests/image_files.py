"""Image files made in the tests: encoded by Pillow, or written byte by byte
where Pillow would not write them cheaply."""
import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encoded(image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def pixels(seed: int = 0, width: int = 40, height: int = 30) -> Image.Image:
    """Seeded random RGB pixels."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def huge_blank_png(width: int, height: int) -> bytes:
    """A valid 1-bit greyscale PNG of ``width`` x ``height`` zero pixels,
    compressed by zlib as it is written (20,000 x 20,000: about 50 KB)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    row = b"\0" * (1 + (width + 7) // 8)   # filter byte, then the packed bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def animated_gif(frames: int, size: int = 8) -> bytes:
    """An animated GIF of ``frames`` frames, frame i red i * 20."""
    images = [Image.new("RGB", (size, size), (i * 20, 0, 0)) for i in range(frames)]
    return encoded(images[0], "GIF", save_all=True, append_images=images[1:], duration=40)
