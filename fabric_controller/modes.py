"""The cluster's mode (phased or async) and what it allows: pure decisions.

A cluster in asynchronous mode holds one standing topology for both roles (an epoch of
phase :attr:`orchestrrl.model.Phase.ASYNC`: the training mesh and the trainer -> rollout
circuits at once). The per-phase API stays for synchronous jobs; in asynchronous mode:

- ``training`` and ``generation`` are refused (FailedPrecondition naming the mode): the
  trainer and the engines run at once, there is no phase of one of them to switch to;
- ``weight-sync`` (with or without a checkpoint) keeps the standing circuits: they
  already connect every training pod to every generation pod, so the bytes move over
  them and no circuit is moved;
- ``async`` itself is entered and left only by a mode change (SetMode).
"""

from __future__ import annotations

from orchestrrl import errors
from orchestrrl.model import Mode, Phase


def effective_phase(current: Phase | None, asked: Phase) -> Phase:
    """The phase a SetPhase for ``asked`` commits when the committed epoch has
    ``current``; FailedPrecondition when the cluster's mode refuses it."""
    if asked is Phase.ASYNC:
        raise errors.field_error(
            "phase", asked.value, "generation, training or weight-sync (async mode is set "
            "with SetMode: `orlctl mode set async`)",
        )  # fmt: skip
    if current is not Phase.ASYNC:
        return asked
    if asked is Phase.WEIGHT_SYNC:
        return Phase.ASYNC  # the standing circuits carry the weights
    raise errors.FailedPrecondition(
        f"cannot set phase {asked.value}: the cluster is in async mode (trainer and rollout "
        "run at once on one standing topology); `orlctl mode set phased` first, or push "
        "weights with the weight-sync phase"
    )


def mode_target(current: Phase | None, mode: Mode, leave_to: Phase | None) -> Phase | None:
    """The phase a mode change commits (None: nothing to change, the cluster is in
    ``mode`` already). ``leave_to``: the phase to commit when leaving async mode (None:
    generation); InvalidArgument when it is given for entering async mode or is not one
    of the synchronous phases."""
    if mode is Mode.ASYNC:
        if leave_to is not None:
            raise errors.field_error(
                "phase", leave_to.value, "unspecified when entering async mode (the phase "
                "is given only when leaving it, with mode=phased)",
            )  # fmt: skip
        return Phase.ASYNC
    if leave_to is Phase.ASYNC:
        raise errors.field_error("phase", leave_to.value, "generation, training or weight-sync")
    if current is not Phase.ASYNC:
        return None
    return leave_to or Phase.GENERATION
