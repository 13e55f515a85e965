"""The run directory of a testbed: its plan, its processes, its logs.

Layout of ``<run dir>`` (default ``/run/orchestrrl-testbed/<id>``)::

    state.json     the plan (namespaces, addresses, capacities), the processes, timings
    wiring.toml    the augmented wiring the controller loads
    state.db       the controller's SQLite state
    ready/         one file per daemon with its bound address, once serving
    logs/          one log per daemon

``orl-testbed down`` does not need any of it: it finds the testbed's namespaces, host
interfaces and processes by name prefix and by the ``ORL_TESTBED`` environment
variable every process of the testbed carries.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from sim_backends.testbed.plan import (
    Daemon,
    End,
    Link,
    NodePlan,
    OcsPlan,
    Scale,
    TestbedPlan,
    TorPlan,
)

RUN_ROOT = Path("/run/orchestrrl-testbed")
STATE_FILE = "state.json"
ENV_MARKER = "ORL_TESTBED"  # every process of testbed ID runs with ORL_TESTBED=ID


def default_run_dir(testbed_id: str) -> Path:
    return RUN_ROOT / testbed_id


@dataclass(frozen=True)
class Proc:
    role: str
    name: str
    pid: int
    netns: str | None
    address: str
    log: str


@dataclass(frozen=True)
class State:
    plan: TestbedPlan
    procs: tuple[Proc, ...] = ()
    ready: bool = False  # `up` finished
    created_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


def _plan_to_json(plan: TestbedPlan) -> dict[str, Any]:
    data = asdict(plan)
    data.pop("wiring")
    data["scale"] = plan.scale.divisor
    return data


def _plan_from_json(data: dict[str, Any]) -> TestbedPlan:
    run_dir = Path(data["run_dir"])
    return TestbedPlan(
        id=data["id"],
        run_dir=data["run_dir"],
        scale=Scale(float(data["scale"])),
        uplink_gbps=float(data["uplink_gbps"]),
        mgmt_bridge=data["mgmt_bridge"],
        mgmt_cidr=data["mgmt_cidr"],
        controller=data["controller"],
        nodes=tuple(NodePlan(**n) for n in data["nodes"]),
        tors=tuple(
            TorPlan(
                **{
                    **t,
                    "node_ports": tuple(t["node_ports"]),
                    "uplinks": tuple((d, ip) for d, ip in t["uplinks"]),
                }
            )
            for t in data["tors"]
        ),
        ocses=tuple(OcsPlan(**o) for o in data["ocses"]),
        links=tuple(
            Link(x["kind"], End(**x["a"]), End(**x["b"]), x["mbps"]) for x in data["links"]
        ),
        daemons=tuple(Daemon(**{**d, "argv": tuple(d["argv"])}) for d in data["daemons"]),
        wiring=wiring_mod.load(run_dir / "wiring.toml"),
        source=data.get("source", ""),
    )


def save(state: State) -> None:
    run_dir = Path(state.plan.run_dir)
    data = {
        "plan": _plan_to_json(state.plan),
        "procs": [asdict(p) for p in state.procs],
        "ready": state.ready,
        "created_at": state.created_at,
        "timings": state.timings,
    }
    tmp = run_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(run_dir / STATE_FILE)


def load(run_dir: Path) -> State | None:
    """The state of the testbed in ``run_dir``; None when there is none."""
    path = run_dir / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise errors.FailedPrecondition(
            f"{path}: unreadable testbed state ({exc}); `orl-testbed down --id ID` removes "
            "the testbed without it"
        ) from None
    return State(
        plan=_plan_from_json(data["plan"]),
        procs=tuple(Proc(**p) for p in data["procs"]),
        ready=bool(data["ready"]),
        created_at=float(data["created_at"]),
        timings={k: float(v) for k, v in data.get("timings", {}).items()},
    )


def require(run_dir: Path, testbed_id: str) -> State:
    state = load(run_dir)
    if state is None:
        raise errors.NotFound(
            f"no testbed state in {run_dir}: is testbed {testbed_id!r} up? "
            f"(`orl-testbed status --id {testbed_id}`; pass --run-dir if it was started with one)"
        )
    if not state.ready:
        raise errors.FailedPrecondition(
            f"testbed {testbed_id!r} in {run_dir} is not ready (still starting, or `up` "
            f"failed); see `orl-testbed status --id {testbed_id}`"
        )
    return state


def marked_pids(testbed_id: str) -> list[int]:
    """Processes whose environment carries ORL_TESTBED=<id> (zombies excluded)."""
    needle = f"{ENV_MARKER}={testbed_id}".encode()
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    try:
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except IndexError:
        return False
