"""The slack gate: reconfigure only when the change fits in the traffic's idle window.

The paper's rule: an OCS reconfiguration is committed only when the predicted idle
window of the traffic exceeds the switching time, so rewiring never sits on the
job's critical path; otherwise the current topology stays.
"""

from __future__ import annotations

from dataclasses import dataclass

# Time for links to carry traffic again after the optics settle (transceiver CDR
# lock, ToR port up). MixNet places the OCS above the ToRs precisely so that no host
# NIC re-activates (5.7 s mean when it does); ToR-side lock is milliseconds.
DEFAULT_SETTLING_MARGIN_S = 0.005


@dataclass(frozen=True)
class GateDecision:
    reconfigure: bool
    reason: str
    needed_s: float
    window_s: float | None


def slack_gate(
    idle_window_s: float | None,
    switching_time_s: float,
    margin_s: float = DEFAULT_SETTLING_MARGIN_S,
) -> GateDecision:
    """Decide whether a change that needs ``switching_time_s`` of optics may proceed.

    ``idle_window_s`` None (or 0 from the wire) means unknown: no gate.
    """
    needed = switching_time_s + margin_s
    if idle_window_s is None or idle_window_s <= 0:
        return GateDecision(True, "no idle window given; not gated", needed, None)
    if idle_window_s >= needed:
        return GateDecision(
            True,
            f"idle window {idle_window_s * 1000:.1f} ms covers switching "
            f"{switching_time_s * 1000:.1f} ms + settling {margin_s * 1000:.1f} ms",
            needed,
            idle_window_s,
        )
    return GateDecision(
        False,
        f"kept the current topology: idle window {idle_window_s * 1000:.1f} ms is shorter than "
        f"OCS switching {switching_time_s * 1000:.1f} ms + settling {margin_s * 1000:.1f} ms",
        needed,
        idle_window_s,
    )
