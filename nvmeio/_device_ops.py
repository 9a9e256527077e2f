"""DeviceOpQueue: the background thread that runs a handle's device ops in order.

Ops on CUDA tensors (staged by cuda_staging, or through cuFile by gds_handle)
run one at a time, in submission order, on one thread per handle; ``wait()``
drains the queue. See [Note: async ops on CUDA tensors and data races] in
cuda_staging.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

__all__ = ["DeviceOpQueue"]


class DeviceOpQueue:
    """Runs a handle's device ops one at a time, in submission order, on one
    background thread (started on the first op). ``drain()`` is the device
    half of ``wait()``; see [Note: async ops on CUDA tensors and data races]."""

    def __init__(self, name: str = "nvmeio-device-ops") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._pending = 0    # queued or running
        self._completed = 0  # since the last drain
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("this handle's device op queue is closed")
            self._jobs.append(job)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return self._pending

    def drain(self) -> "tuple[int, BaseException | None]":
        """Waits until no op is queued or running; returns how many completed
        since the last drain and the first error among them (not raised)."""
        with self._cv:
            while self._pending:
                self._cv.wait()
            n, self._completed = self._completed, 0
            errors, self._errors = self._errors, []
        return n, (errors[0] if errors else None)

    def close(self) -> None:
        """Lets queued ops finish, then ends the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            error: Optional[BaseException] = None
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to wait()
                error = exc
            job = None  # release the op's buffers before it is reported done
            with self._cv:
                self._pending -= 1
                self._completed += 1
                if error is not None:
                    self._errors.append(error)
                self._cv.notify_all()
