"""Fencing tokens on southbound commands (controller high availability, docs/ha.md).

A leader controller stamps every OCS batch and route command with its fencing token (the
create revision of its etcd election key: every new leader's token is larger). A switch
or an agent remembers the newest token it has seen and refuses an older one, so a deposed
leader that resumes (after a freeze, a partition) changes nothing. Token 0 (absent) means
"no HA": a single controller, admitted as before fencing existed, but only until a
non-zero token has been seen: from then on the cluster runs HA, and a command without a
token (a controller started without --etcd, a tool, a forged request) is refused like an
old one (issue 28). Leaving HA means restarting the switch or agent (the newest token
lives in its memory; a NETCONF switch keeps it in its datastore, ``/controller/
fencing-token``, which must be cleared).
"""

from __future__ import annotations

from orchestrrl import errors


class FencingGate:
    """The newest fencing token ``what`` (a switch, an agent's route table) has seen."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.newest = 0

    def admit(self, token: int) -> None:
        """Admit a command stamped with ``token`` (remembering it if newer), or raise
        ``FailedPrecondition`` naming it and the newest seen if it is older."""
        if token < 0:
            raise errors.field_error("fencing_token", token, "0 (no HA) or a leader's token > 0")
        if token == 0 and self.newest:  # HA seen: no token is no leader's (issue 28)
            raise errors.FailedPrecondition(
                f"{self.what}: a command without a fencing token (0: no HA), but an HA leader "
                f"has commanded this with token {self.newest}: only the current leader may "
                "change it (restart it to leave HA); this command changed nothing"
            )
        if token == 0:
            return
        if token < self.newest:
            raise errors.FailedPrecondition(
                f"{self.what}: fencing token {token} is older than the newest seen, "
                f"{self.newest}: a newer controller leads, this command changed nothing"
            )
        self.newest = token
