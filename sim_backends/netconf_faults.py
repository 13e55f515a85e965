"""Faults of a NETCONF switch that a faithful server (netconfd) never shows, for tests:
a switch whose read-back differs from what it acknowledged, and one without
:confirmed-commit:1.1. Both wrap the real driver against the real server: only what the
driver reads back, or which capabilities it sees, is altered."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fabric_controller.drivers import netconf_xml as nx
from fabric_controller.drivers.netconf import NetconfOcsDriver


class MisreadingNetconfDriver(NetconfOcsDriver):
    """``misread_next(port)``: the next read-back after a commit lacks the pair whose
    ingress is ``port`` (as a switch whose mirror did not move would report it), once.
    ``plain_commit``: behave as against a server without :confirmed-commit:1.1."""

    def __init__(self, *args: Any, plain_commit: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plain_commit = plain_commit
        self._misread = 0
        self.misread = 0

    def misread_next(self, port: int) -> None:
        self._misread = port

    @property
    def confirmed_commit(self) -> bool:
        return super().confirmed_commit and not self.plain_commit

    def _read_back(self, mgr: Any) -> nx.SwitchState:
        state = super()._read_back(mgr)
        port, self._misread = self._misread, 0
        if not port:
            return state
        self.misread += 1
        return replace(state, pairs=frozenset(p for p in state.pairs if p[0] != port))
