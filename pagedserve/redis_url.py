"""What a Redis URL may be (plain or TLS, with an ACL user), and how one is shown."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss")


def check_redis_url(url: str) -> None:
    """Raise ValueError (showing the URL without its password) unless ``url`` is a
    redis:// or rediss:// URL."""
    if urlsplit(url).scheme not in SCHEMES:
        raise ValueError(f"a Redis URL must be redis:// or rediss:// (TLS), got {redacted(url)!r}")


def redacted(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: fit for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))
