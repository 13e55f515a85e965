"""Entry point of orl-node-agent (also ``python -m node_agent.main``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from node_agent.config import ConfigProblems, load, parse_command_line, to_toml
from node_agent.daemon import run_agent
from orchestrrl.grpcutil import run
from orchestrrl.logs import setup_logging

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command = parse_command_line(argv)
    except SystemExit as exc:  # argparse: --help (0) or an unknown flag (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except ConfigProblems as exc:
        return _problems(exc)
    try:
        config = load(command.source)
    except ConfigProblems as exc:
        return _problems(exc)
    if command.check_only:
        sys.stdout.write(to_toml(config))
        return 0
    setup_logging(config.log_level, config.log_format)
    source = command.source
    return run(
        lambda: run_agent(
            config,
            reload=(lambda: load(source)) if source.path is not None else None,
            set_log_level=lambda level: setup_logging(level, config.log_format),
        )
    )


def _problems(exc: ConfigProblems) -> int:
    count = len(exc.problems)
    print(
        f"orl-node-agent: {count} configuration problem{'s' if count > 1 else ''}:",
        file=sys.stderr,
    )
    for problem in exc.problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
