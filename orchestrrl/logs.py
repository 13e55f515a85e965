"""Structured logging setup shared by every daemon and the CLI.

JSON lines in production (systemd/journald), readable key=value on a terminal.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

LogFormat = Literal["auto", "json", "console"]


def setup_logging(
    level: str = "info", fmt: LogFormat = "auto", stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger once per process."""
    out = stream if stream is not None else sys.stderr
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric, stream=out, format="%(levelname)s %(name)s %(message)s")


def get_logger(name: str, **bound: object) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger.bind(**bound) if bound else logger
