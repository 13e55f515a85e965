"""`orlctl demo-rl --mode async` options: bad values are named with what is allowed."""

from __future__ import annotations

import pytest

from fabric_controller import cli
from fabric_controller.demo_rl import RLConfig
from orchestrrl import errors

pytestmark = pytest.mark.unit


def test_async_options_are_checked() -> None:
    RLConfig(mode="async", max_staleness=0, in_flight="finish").check()
    with pytest.raises(errors.InvalidArgument) as info:
        RLConfig(mode="sideways", max_staleness=17, in_flight="later").check()
    message = str(info.value)
    assert "--mode='sideways' is not valid: phased or async" in message
    assert "--max-staleness=17 is not valid: an integer in 0..16" in message
    assert "--in-flight='later' is not valid: resume or finish" in message
    with pytest.raises(errors.InvalidArgument, match="--rollout='partial' is not valid: full"):
        RLConfig(mode="async", rollout="partial").check()


def test_the_cli_refuses_them_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-rl", "--mode", "async", "--max-staleness", "-1"]) == 2
    assert "--max-staleness=-1 is not valid: an integer in 0..16" in capsys.readouterr().err
