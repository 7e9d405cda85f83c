"""The one error an SGLang endpoint raises, apart so the client and its weight-update endpoints share it."""

from __future__ import annotations


class SglangError(RuntimeError):
    """An SGLang endpoint failed; the message names the URL, the endpoint and what the server said.

    `status` is the HTTP status when the server answered (None when it did not).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
