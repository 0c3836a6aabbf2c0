"""The API keys both front doors accept, and who a request sent with each one belongs to."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from pagedserve.settings import ApiConfig
from scheduler_svc.api.errors import APIError


def owner_of(key: str | None) -> str:
    """Who a request recorded with this API key belongs to: a short hash of the key ("" on
    a server without keys). Each key is its own owner, who may see (and abort) only the
    requests sent with it; clients that share a key share their requests."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys in ``path``: one a line; blank lines and lines starting with # skipped."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


class ApiKeys:
    """The accepted keys. A sent value is checked against every key, each in constant time
    over digests of equal length, so the time taken tells neither which key nor how much
    of a guess matched. Keys are held as digests only, never logged."""

    def __init__(self, keys: tuple[str, ...], max_requests_per_key: int = 0) -> None:
        self._expected = [(_digest(f"Bearer {k}".encode()), owner_of(k)) for k in keys]
        self.max_requests_per_key = max_requests_per_key
        self._in_flight: Counter[str] = Counter()

    @classmethod
    def from_config(cls, config: ApiConfig) -> ApiKeys:
        """The keys of ``--api-key`` and ``--api-key-file`` together."""
        file_keys = read_key_file(config.api_key_file) if config.api_key_file else ()
        return cls(config.api_keys + file_keys, config.max_requests_per_key)

    def hold(self, owner: str) -> contextlib.AbstractContextManager[None]:
        """One more completion in flight for ``owner`` while the returned context is open;
        a 429 (APIError) instead when the key already has its most (no limit without keys:
        every client is then the same owner)."""
        limit = self.max_requests_per_key
        if owner and limit and self._in_flight[owner] >= limit:
            raise APIError(
                429,
                f"this API key already has {limit} requests in flight "
                "(--max-requests-per-key): wait for one to finish",
                code="too_many_requests_per_key",
                type="rate_limit_error",
            )
        return self._counted(owner)

    @contextlib.contextmanager
    def _counted(self, owner: str) -> Iterator[None]:
        self._in_flight[owner] += 1
        try:
            yield
        finally:
            self._in_flight[owner] -= 1
            if not self._in_flight[owner]:
                del self._in_flight[owner]

    def __bool__(self) -> bool:
        return bool(self._expected)

    def owner(self, authorization: bytes | str) -> str | None:
        """The owner of the key an ``Authorization`` value (``Bearer KEY``) carries: None
        for no accepted key, "" when no keys are set (every request is let in)."""
        if not self._expected:
            return ""
        sent = authorization.encode() if isinstance(authorization, str) else authorization
        digest, found = _digest(sent), None
        for expected, owner in self._expected:  # no early exit: every key is compared
            if hmac.compare_digest(digest, expected):
                found = owner
        return found


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()
