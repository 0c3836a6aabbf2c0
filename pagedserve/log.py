"""The one logging configuration: structlog to stderr, JSON lines or coloured console."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json: bool | None = None) -> None:
    """Configure structlog for this process; call once from an entry point.

    Args:
        json: JSON lines (for collectors) or console lines; default: JSON unless stderr
            is a terminal.
    """
    if json is None:
        json = not sys.stderr.isatty()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=True))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
