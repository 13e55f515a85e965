"""One log format for every line: structlog's events and stdlib loggers' records alike."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from orchestrrl.logs import get_logger, setup_logging

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**config)
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
    root.setLevel(level)


def test_stdlib_records_and_their_tracebacks_are_json_lines_like_structlogs() -> None:
    out = io.StringIO()
    setup_logging("info", "json", out)
    get_logger("orchestrrl.test").info("node_registered", node="gen0-n0")
    try:
        raise ValueError("bad bytes")
    except ValueError:
        # what grpc.aio logs when a servicer raises (the fuzzing found 3,382 such lines)
        logging.getLogger("grpc._cython.cygrpc").exception(
            "Unexpected [%s] raised by servicer method [%s]", "ValueError", "/x.Y/Z"
        )
    logging.getLogger("asyncio").debug("below the level: not written")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    ours, theirs = (json.loads(line) for line in lines)
    assert ours["event"] == "node_registered" and ours["level"] == "info"
    assert theirs["event"] == "Unexpected [ValueError] raised by servicer method [/x.Y/Z]"
    assert theirs["level"] == "error" and theirs["logger"] == "grpc._cython.cygrpc"
    assert theirs["exception"].endswith("ValueError: bad bytes")
    assert set(ours) - {"node"} <= set(theirs)  # the same fields: event, level, timestamp


def test_setting_up_again_replaces_the_handler_and_the_level() -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("info", "json", first)
    setup_logging("warning", "json", second)  # e.g. a config reload
    logging.getLogger("x").info("quiet now")
    logging.getLogger("x").warning("once")
    assert first.getvalue() == ""
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == ["once"]


def test_console_format_renders_stdlib_records_too() -> None:
    out = io.StringIO()
    setup_logging("info", "console", out)
    logging.getLogger("grpc").warning("hello %s", "there")
    text = out.getvalue()
    assert "hello there" in text and "[warning" in text and "grpc" in text
