"""The worker threads that take requests with images, off the intake thread.

Decoding an image (up to ``max_image_pixels``) and the model's processor,
which runs inside the engine's ``add_request`` for a vision model, take
milliseconds to a second; on the intake thread they would hold up every
request behind them. A request with images is handed to this pool instead;
at most ``workers`` run at once and ``queue`` more wait, and one beyond that
is refused at once (the caller answers UNAVAILABLE) rather than queued
without bound.
"""
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from pagedbackend.serving.constants import IMAGES_BUSY


class ImagePool:
    """A bounded pool of worker threads: ``try_submit`` refuses when full."""

    def __init__(self, workers: int, queue: int):
        self.capacity = workers + queue
        self._slots = threading.BoundedSemaphore(self.capacity)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="paged_llm-images")

    def try_submit(self, work: Callable, *args) -> bool:
        """Run ``work(*args)`` on a worker; False (nothing queued) when
        ``capacity`` requests are running or waiting already."""
        if not self._slots.acquire(blocking=False):
            return False

        def run():
            try:
                work(*args)
            finally:
                self._slots.release()
        try:
            self._executor.submit(run)
        except RuntimeError:   # shut down
            self._slots.release()
            return False
        return True

    def busy_message(self) -> str:
        return (f"{IMAGES_BUSY}: {self.capacity} requests with images are being decoded or wait for it "
                "(parameters IMAGE_WORKERS and IMAGE_QUEUE); retry later")

    def shutdown(self) -> None:
        """Wait for the work queued to end (each one sees the server closing and answers at once)."""
        self._executor.shutdown(wait=True)
