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

What may raise the newest token is bounded, so that one command cannot jam the fence
(a token of 2**63 would otherwise make the switch refuse the real leader until it
restarts):

- only a command that was carried out and asked for a change raises it (``record``
  after the change; ``check`` before it changes nothing): a refused command, an invalid
  one and an empty one are checked against the newest token but never raise it;
- a token more than ``MAX_TOKEN_STEP`` ahead of the newest seen (of 0 at first) is
  refused: tokens are etcd revisions, which grow by one per write to the etcd cluster,
  so a real leader's token is never that far ahead.

A switch or agent cannot tell on its own whether a token within that bound is the
current leader's; a peer allowed to send commands (any controller's certificate with
mutual TLS) can still raise it by up to the bound with a real change.
"""

from __future__ import annotations

from orchestrrl import errors

# How far ahead of the newest token seen a new one may be: 2**40 etcd revisions are 35
# years of 1,000 writes a second, far beyond any real leader's token.
MAX_TOKEN_STEP = 1 << 40


class FencingGate:
    """The newest fencing token ``what`` (a switch, an agent's route table) has seen."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.newest = 0

    def check(self, token: int) -> None:
        """Raise unless a command stamped with ``token`` may run: ``FailedPrecondition``
        naming it and the newest seen when it is older, ``InvalidArgument`` when it is
        negative or more than ``MAX_TOKEN_STEP`` ahead. Remembers nothing."""
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
        if token - self.newest > MAX_TOKEN_STEP:
            raise errors.field_error(
                "fencing_token",
                token,
                f"at most {MAX_TOKEN_STEP} (2**40) ahead of the newest seen by {self.what}, "
                f"{self.newest}: leaders' tokens are etcd revisions, which never jump that "
                "far; this command changed nothing",
            )

    def record(self, token: int) -> None:
        """Remember ``token`` after a command stamped with it (checked first) carried out
        a change; never for a refused, invalid or empty command."""
        self.newest = max(self.newest, token)
