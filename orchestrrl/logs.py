"""Structured logging setup shared by every daemon and the CLI.

JSON lines in production (systemd/journald), readable key=value on a terminal. One
format for every line a process writes: structlog's own events and the records of
stdlib loggers (grpc, asyncio, aiohttp, ...) go through the same processors and the
same renderer (structlog's ``ProcessorFormatter`` on the root logger), so a library's
traceback is one JSON line with an ``exception`` field, never raw text in the stream.
Event names: snake_case words (``request_undecodable``), the style of most of the code;
records of other libraries keep their message as the event and name their ``logger``.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

LogFormat = Literal["auto", "json", "console"]


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root logger's handler installed by ``setup_logging`` (replaced by a new call)."""


def setup_logging(
    level: str = "info", fmt: LogFormat = "auto", stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger (again on every call: a new level,
    format or stream replaces the previous ones)."""
    out = stream if stream is not None else sys.stderr
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = _Handler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)


def get_logger(name: str, **bound: object) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger.bind(**bound) if bound else logger
