"""Entry point of orl-node-agent (also ``python -m node_agent.main``)."""

from __future__ import annotations

from collections.abc import Sequence

from node_agent.config import parse_args
from node_agent.daemon import run_agent
from orchestrrl.grpcutil import run
from orchestrrl.logs import setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else 2
    setup_logging(config.log_level, config.log_format)
    return run(lambda: run_agent(config))


if __name__ == "__main__":
    raise SystemExit(main())
