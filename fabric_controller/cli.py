"""orlctl: the operator's and the RL loop's command line for OrchestrRL.

Every command takes --json for scripts; --controller HOST:PORT or $ORL_CONTROLLER
selects the controller (default 127.0.0.1:50051); several separated by commas are the
controllers of an HA group, and every call follows the one that leads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog

from fabric_controller import local
from orchestrrl import add_version_flag, errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import (
    CircuitView,
    Client,
    ModeState,
    NodeView,
    PhaseChange,
    ScheduleView,
    WeightSyncIncomplete,
    WeightSyncView,
    controller_addresses,
    to_json,
)
from orchestrrl.convert import optional_phase_from_pb
from orchestrrl.logs import setup_logging
from orchestrrl.model import SYNC_PHASES, Mode, Phase
from orchestrrl.tls import TlsConfig
from orchestrrl.tls import from_args as tls_from_args

PHASES = [p.value for p in SYNC_PHASES]


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the sub-command."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--controller",
        default=argparse.SUPPRESS,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="controller address, or the addresses of an HA group separated by commas: calls "
        "follow the leader (default: $ORL_CONTROLLER or 127.0.0.1:50051)",
    )
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print machine-readable JSON"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        metavar="S",
        help="seconds to wait for the controller (default 30)",
    )
    for flag, env, what in (
        ("--tls-cert", "ORL_TLS_CERT", "operator certificate"),
        ("--tls-key", "ORL_TLS_KEY", "its private key"),
        ("--tls-ca", "ORL_TLS_CA", "the CA of the controller's certificate"),
    ):
        p.add_argument(
            flag,
            type=Path,
            default=argparse.SUPPRESS,
            metavar="PEM",
            help=f"{what}, for mutual TLS (default: ${env}; none of them: plaintext)",
        )
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    p = argparse.ArgumentParser(
        prog="orlctl",
        description="Control an OrchestrRL fabric: phases, nodes, topology, local clusters.",
        parents=[common],
    )
    add_version_flag(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(parent: Any, name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = parent.add_parser(
            name, help=help_text, description=help_text, parents=[common]
        )
        return parser

    phase = add(sub, "phase", "get, set or plan the cluster phase")
    psub = phase.add_subparsers(dest="action", required=True, metavar="ACTION")
    add(psub, "get", "show the committed phase, epoch and circuits")
    pset = add(psub, "set", "change the phase: program the OCS and commit a new epoch")
    pset.add_argument("phase", choices=PHASES)
    pset.add_argument(
        "--idle-window-ms",
        type=float,
        default=0.0,
        help="predicted idle window of the traffic; when shorter than the OCS switching "
        "time plus settling, the topology is kept (default 0: unknown, no gate)",
    )
    pset.add_argument(
        "--request-id",
        default="",
        help="idempotency key: a retry with the same phase returns the first result (a new "
        "epoch, 'nothing to change' or a gated answer) instead of applying again; the same "
        "key with another phase is refused",
    )
    ws = pset.add_argument_group(
        "weight sync (with weight-sync: every generation node fetches the checkpoint over the "
        "phase's circuits and loads it; the answer says when all of them run it)"
    )
    ws.add_argument("--checkpoint", metavar="VERSION", default="", help="the checkpoint's version")
    ws.add_argument(
        "--from",
        dest="source",
        metavar="NODE",
        default="",
        help="the node whose agent serves it (its checkpoint_dir), e.g. a training node",
    )
    ws.add_argument(
        "--checksum",
        metavar="HEX",
        default="",
        help="that checkpoint exactly (64 hex digits; default: the source's newest of VERSION)",
    )
    ws.add_argument(
        "--in-flight",
        choices=("finish", "resume"),
        default="finish",
        help="requests running at the load: finish on the old weights, or resume on the new "
        "ones (default finish)",
    )
    ws.add_argument(
        "--sync-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds each node may take to fetch and load (default 600)",
    )
    ws.add_argument(
        "--streams",
        type=int,
        default=0,
        metavar="N",
        help="connections each node fetches over (default 4)",
    )
    pplan = add(psub, "plan", "show what `phase set` would change, without changing anything")
    pplan.add_argument("phase", choices=PHASES)

    mode = add(
        sub,
        "mode",
        "show or set the cluster's mode: phased (phase by phase) or async (trainer and "
        "rollout at once on one standing topology)",
    )
    msub = mode.add_subparsers(dest="action", metavar="ACTION")
    add(msub, "get", "show the mode (the default action)")
    mset = add(msub, "set", "change the mode: commit the standing topology, or leave it")
    mset.add_argument("mode", help="phased or async")
    mset.add_argument(
        "--phase",
        choices=PHASES,
        default=None,
        help="leaving async mode: the phase to commit (default generation)",
    )
    mset.add_argument("--request-id", default="", help="idempotency key, as `phase set`")

    add(sub, "nodes", "list the nodes of the wiring with their health and telemetry")
    topo = add(sub, "topology", "show the wiring and the current circuits")
    tsub = topo.add_subparsers(dest="action", required=True, metavar="ACTION")
    add(tsub, "show", "show pods, ToRs, OCSes and the circuits of the current epoch")

    events = add(sub, "events", "print recent controller events; --follow for new ones")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--recent", type=int, default=20, help="recent events first (default 20)")
    events.add_argument("--count", type=int, default=0, help="stop after N events (0: never)")

    plan = add(sub, "plan", "show what a change would do, changing nothing")
    plsub = plan.add_subparsers(dest="action", required=True, metavar="WHAT")
    plan_phase = add(plsub, "phase", "the circuits a phase change would add and remove")
    plan_phase.add_argument("phase", choices=PHASES)

    sched = add(sub, "schedule", "the compute-scheduling loop: its plan, why, and its actions")
    ssub = sched.add_subparsers(dest="action", required=True, metavar="ACTION")
    add(ssub, "show", "the current compute plan with its explanation and the last actions")
    add(ssub, "pause", "pause the loop: it observes and plans nothing until resumed")
    add(ssub, "resume", "resume the loop: its next round re-plans at once")

    config = add(sub, "config", "validate wiring files")
    csub = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = add(csub, "check", "validate a wiring file and print it normalised")
    check.add_argument("file", type=Path)

    loc = add(sub, "local", "run a whole cluster locally (simulated OCS, controller, agents)")
    lsub = loc.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("up", "start the cluster in the background"),
        ("down", "stop the cluster"),
        ("status", "show the cluster's processes"),
    ):
        lp = add(lsub, name, text)
        lp.add_argument(
            "--run-dir",
            type=Path,
            default=local.run_dir_default(),
            help="where pids, addresses, logs and state live (default: $ORL_RUN_DIR "
            "or ./.orl-local)",
        )
        if name == "up":
            lp.add_argument(
                "--wiring",
                type=Path,
                default=wiring_mod.default_wiring_path(),
                help="wiring file (default: the embedded 8-node example)",
            )
            lp.add_argument(
                "--ephemeral-ports",
                action="store_true",
                help="bind every daemon to a free port instead of the wiring's",
            )
            lp.add_argument(
                "--ha",
                type=int,
                nargs="?",
                const=2,
                default=0,
                metavar="N",
                help="high availability: N controllers (2 or 3; default 2) on a local "
                "3-member etcd cluster instead of one controller on SQLite",
            )
            lp.add_argument(
                "--ocs",
                choices=list(local.OCS_KINDS),
                default="sim",
                help="sim: the simulated OCS over gRPC (default); netconf: each OCS is a "
                "real NETCONF server (netconfd with our YANG module behind a private sshd "
                "on loopback; needs root and `make deps`) driven by the NETCONF driver",
            )
            add_local_engine_arguments(lp)

    certs = add(sub, "certs", "certificates for trying mutual TLS")
    cert_sub = certs.add_subparsers(dest="action", required=True, metavar="ACTION")
    dev = add(cert_sub, "dev", "write a throwaway CA and certificates (not for production)")
    dev.add_argument("--out", type=Path, required=True, help="directory to write PEM files to")
    dev.add_argument(
        "names",
        nargs="+",
        help="identities: the controller (orl-fabric-controller), node names, operators",
    )

    demo = add(sub, "demo", "start a local cluster, walk RL phases for a few steps, stop it")
    demo.add_argument("--wiring", type=Path, default=wiring_mod.default_wiring_path())
    demo.add_argument("--steps", type=int, default=3, help="RL steps to simulate (1-100)")
    demo.add_argument(
        "--run-dir", type=Path, default=None, help="run directory (default: a temporary directory)"
    )
    de = add(
        sub,
        "demo-engines",
        "a local cluster on real CPU engines: requests migrate and nodes reshard, outputs "
        "checked against uninterrupted runs",
    )
    de.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    de.add_argument("--engine-command", default="", metavar="PATH", help="default: from .engines/")
    de.add_argument("--requests", type=int, default=8, help="requests of the step (1-16)")
    de.add_argument(
        "--max-tokens",
        type=int,
        default=2000,
        help="the longest request's tokens (16-4000); the others get less, a long tail",
    )
    de.add_argument("--equal-lengths", action="store_true", help="every request --max-tokens long")
    de.add_argument(
        "--run-dir", type=Path, default=None, help="run directory (default: a temporary one)"
    )
    rl = add(
        sub,
        "demo-rl",
        "a real GRPO loop on CPU engines through the gateways: generation, training and "
        "weight sync every step; prints a row per step and plots the reward",
    )
    rl.add_argument("--engine", default="llamacpp", help="llamacpp or vllm")
    rl.add_argument("--engine-command", default="", metavar="PATH", help="default: from .engines/")
    rl.add_argument("--steps", type=int, help="RL steps (1-1000; default 10)")
    rl.add_argument("--prompts", type=int, help="groups per step (default 4)")
    rl.add_argument("--samples", type=int, help="samples per prompt (default 8)")
    rl.add_argument("--max-tokens", type=int, help="tokens per response at most (default 1024)")
    rl.add_argument(
        "--rollout",
        help="full (default), or partial: a step ends when --prompts groups are complete "
        "and the unfinished responses go on into the next step, on the new weights",
    )
    rl.add_argument(
        "--over-provision",
        type=float,
        help="partial: groups in flight per group trained, 1.0-2.0 (default 1.5)",
    )
    rl.add_argument(
        "--max-staleness",
        type=int,
        help="partial: weight versions a response may span beyond the current; async: "
        "groups start at most (1 + this) batches ahead of the trainer and a group more "
        "versions behind is dropped (default 1)",
    )
    rl.add_argument("--seed", type=int)
    rl.add_argument("--lr", type=float, help="the trainer's learning rate")
    rl.add_argument("--vocab", type=int, help="the policy's vocabulary size")
    rl.add_argument("--hidden", type=int, help="the policy's hidden size")
    rl.add_argument("--layers", type=int, help="the policy's layers")
    rl.add_argument("--target-length", type=int, help="the task's target response length")
    rl.add_argument("--length-weight", type=float, help="the reward's weight on the length")
    rl.add_argument("--ramble", type=float, help="the first policy's logit spread (0: off)")
    rl.add_argument("--seats", type=int, help="sequences per engine instance")
    rl.add_argument(
        "--mode",
        help="phased (default: generation, training, weight-sync in turn) or async (trainer "
        "and rollout at once on the cluster's async mode)",
    )
    rl.add_argument(
        "--in-flight",
        help="async: requests running at a weight update resume on the new weights "
        "(resume, default) or finish on the old ones (finish)",
    )
    rl.add_argument(
        "--plot", type=Path, default=Path("demo-rl-reward.png"), help="the reward curve (PNG)"
    )
    rl.add_argument(
        "--run-dir", type=Path, default=None, help="run directory (default: a temporary one)"
    )
    return p


def add_local_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "a real rollout engine on the generation nodes (default: every node simulated)"
    )
    g.add_argument("--engine", choices=["vllm", "llamacpp", "sglang"], help="the engine")
    g.add_argument("--engine-model", metavar="PATH", help="its weights (directory or GGUF)")
    g.add_argument(
        "--engine-command",
        metavar="PATH",
        help="the Python with vLLM/SGLang, or llama-server (default: from .engines/, "
        "which `make engines` fills)",
    )
    g.add_argument("--engine-arg", action="append", default=[], metavar="ARG", help="repeatable")
    g.add_argument("--tp-layout", default="", metavar="T,T", help="each generation node's")
    g.add_argument("--engine-max-num-seqs", type=int, default=8, metavar="N")
    g.add_argument("--engine-context", type=int, default=2048, metavar="N")


def local_engine(args: argparse.Namespace) -> local.LocalEngine | None:
    """The --engine options as a LocalEngine (None without --engine)."""
    if getattr(args, "engine", None) is None:
        for flag in ("engine_model", "engine_command"):
            if getattr(args, flag, None):
                raise errors.InvalidArgument(f"--{flag.replace('_', '-')} needs --engine")
        return None
    if not args.engine_model:
        raise errors.InvalidArgument(f"--engine {args.engine} needs --engine-model PATH")
    command = args.engine_command or local.installed_engine(args.engine)
    if command is None:
        raise errors.InvalidArgument(
            f"--engine {args.engine}: no --engine-command, and none installed in .engines/ "
            "(run `make engines`)"
        )
    return local.LocalEngine(
        args.engine,
        args.engine_model,
        command,
        tuple(args.engine_arg),
        args.tp_layout,
        args.engine_max_num_seqs,
        args.engine_context,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {_ms(v)}" for k, v in stages.items())


def _by_pair(circuits: Sequence[CircuitView]) -> list[str]:
    groups: dict[tuple[str, str], list[CircuitView]] = defaultdict(list)
    for c in circuits:
        groups[tuple(sorted((c.pod_a, c.pod_b)))].append(c)  # type: ignore[index]
    return [
        f"  {a} <-> {b}: {len(cs)} circuit(s) "
        f"[{', '.join(f'{c.ocs}:{c.a}-{c.b}' for c in sorted(cs, key=lambda c: (c.ocs, c.a)))}]"
        for (a, b), cs in sorted(groups.items())
    ]


def _degraded(r: PhaseChange) -> list[str]:
    if not r.degraded:
        return []
    total = sum(m.circuits for m in r.missing)
    return [
        f"  DEGRADED: {total} circuit(s) missing because OCS ports are down "
        "(re-planned when they come back up):",
        *(f"    {m.pod_a} <-> {m.pod_b}: {m.circuits} missing" for m in r.missing),
    ]


def describe_change(r: PhaseChange) -> str:
    sync = [describe_weight_sync(r.weight_sync)] if r.weight_sync is not None else []
    if r.gated:
        return "\n".join([f"epoch {r.epoch}: not changed: {r.message}", *_degraded(r), *sync])
    if not r.changed:
        return "\n".join([f"epoch {r.epoch}: {r.message}", *_degraded(r), *sync])
    lines = [
        f"epoch {r.epoch}: phase {r.phase}  (+{len(r.added)} -{len(r.removed)} circuits, "
        f"{len(r.circuits)} in place)" + ("  DEGRADED" if r.degraded else ""),
        f"  stages: {_stages(r.stages)}",
        *(f"  {line}" for line in r.explanation.splitlines()),
        *_degraded(r),
    ]
    return "\n".join(lines + _by_pair(r.circuits) + sync)


def describe_weight_sync(w: WeightSyncView) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(w.completed_at)) if w.complete else "-"
    head = (
        f"weight sync: version {w.version} ({w.checksum[:16]}, {w.checkpoint_bytes} bytes) from "
        f"{w.source_node} at {w.source_address}, epoch {w.epoch}: "
        + (f"every generation node runs it (at {when}, {w.seconds:.2f} s)" if w.complete else
           "INCOMPLETE")
    )  # fmt: skip
    rows = [
        f"  {'NODE':<14} {'OK':<3} {'VERSION':<10} {'BYTES':>11} {'FETCH S':>8} "
        f"{'MB/S':>8} {'LOAD S':>7} {'CIRCUITS':>8} {'STREAMS':>7} {'RESUMED':>7}  HOW / ERROR"
    ]
    for n in w.nodes:
        rows.append(
            f"  {n.node:<14} {'yes' if n.ok else 'NO':<3} {n.version or '-':<10} "
            f"{n.bytes_fetched:>11} {n.fetch_seconds:>8.2f} {n.mbytes_per_s:>8.1f} "
            f"{n.load_seconds:>7.2f} {n.circuits:>8} {n.streams:>7} {n.resumes:>7}  "
            + (n.how + (" (had it)" if n.cached else "") if n.ok else n.error)
        )
    return "\n".join([head, *rows, f"  {w.message}"])


def _print(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(to_json(data), indent=2, sort_keys=True))
    else:
        print(text())


def _target(args: argparse.Namespace) -> tuple[tuple[str, ...], float, TlsConfig | None]:
    """Controller addresses, timeout, and mutual TLS when a --tls-* flag or $ORL_TLS_* is set."""
    files = {
        key: getattr(args, key, None) or (Path(os.environ[env]) if os.environ.get(env) else None)
        for key, env in (("tls_cert", "ORL_TLS_CERT"), ("tls_key", "ORL_TLS_KEY"),
                         ("tls_ca", "ORL_TLS_CA"))
    }  # fmt: skip
    tls = tls_from_args(argparse.Namespace(**files), required=False)
    return (
        controller_addresses(getattr(args, "controller", None), "--controller"),
        getattr(args, "timeout", 30.0),
        tls,
    )


def _client(args: argparse.Namespace) -> Client:
    """A client of the controller; mutual TLS when a --tls-* flag or $ORL_TLS_* is set."""
    return Client(*_target(args))


def cmd_phase(args: argparse.Namespace) -> int:
    if args.action == "plan":
        with _client(args) as c:
            plan = c.plan_phase(args.phase)
        _print(
            args,
            plan,
            lambda: "\n".join(
                [
                    f"phase {plan.phase} would add {len(plan.added)} and remove "
                    f"{len(plan.removed)} circuit(s)",
                    *(f"  {line}" for line in plan.explanation.splitlines()),
                    "resulting circuits:",
                    *_by_pair(plan.circuits),
                ]
            ),
        )
        return 0
    with _client(args) as c:
        if args.action == "get":
            s = c.get_phase()
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.committed_at))
            mode = Mode.ASYNC.value if s.phase == Phase.ASYNC.value else Mode.PHASED.value
            header = (
                f"epoch {s.epoch}: phase {s.phase} (mode {mode}), {len(s.circuits)} "
                f"circuit(s), committed {when}"
                if s.epoch
                else "epoch 0: no phase set yet (mode phased)"
            )
            _print(args, s, lambda: "\n".join([header, *_by_pair(s.circuits)]))
        else:
            if not args.idle_window_ms >= 0:
                raise errors.field_error("--idle-window-ms", args.idle_window_ms, "a number >= 0")
            if bool(args.checkpoint) != bool(args.source):
                raise errors.field_error(
                    "--from" if args.checkpoint else "--checkpoint",
                    "",
                    "--checkpoint VERSION and --from NODE are given together",
                )
            try:
                r = c.set_phase(
                    args.phase,
                    args.request_id,
                    args.idle_window_ms / 1000.0,
                    checkpoint=args.checkpoint,
                    source=args.source,
                    checksum=args.checksum,
                    in_flight=args.in_flight,
                    sync_timeout_s=args.sync_timeout,
                    streams=args.streams,
                )
            except WeightSyncIncomplete as exc:
                r = exc.change
                _print(args, r, lambda: describe_change(r))
                print(f"orlctl: error: {exc}", file=sys.stderr)
                return 1
            _print(args, r, lambda: describe_change(r))
    return 0


def describe_mode(m: ModeState) -> str:
    what = {
        Mode.ASYNC.value: "trainer and rollout run at once on one standing topology; "
        "`phase set training|generation` is refused, weight-sync uses the standing circuits",
        Mode.PHASED.value: "the per-phase API (`orlctl phase set`) moves the circuits",
    }.get(m.mode, "")
    line = (
        f"mode {m.mode}: epoch {m.epoch}, phase {m.phase or 'none'}, {m.circuits} circuit(s)"
        f"; {what}"
    )
    return f"{line}\n{m.message}" if m.message else line


def cmd_mode(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.action == "set":
            m = c.set_mode(Mode.parse(args.mode), args.request_id, phase=args.phase)
        else:
            m = c.get_mode()
    _print(args, m, lambda: describe_mode(m))
    return 0


def _node_row(n: NodeView) -> str:
    seen = "never" if n.last_seen_age_s is None else f"{n.last_seen_age_s:.1f}s ago"
    t = n.telemetry
    util = f"{t['gpu_utilization_mean'] * 100:.0f}%" if t else "-"
    tps = f"{t['tokens_per_s']:.0f}" if t else "-"
    layout = "+".join(str(x) for x in t.get("tp_layout", [])) if t else "-"
    return (
        f"{n.node:<14} {n.pod:<10} {n.role:<6} {n.health:<8} {n.agent_address:<22} "
        f"{seen:<11} {n.gpu_backend or '-':<5} {util:>5} {tps:>8} {layout:<8} "
        f"{n.engine or '-':<9} {n.weight_version or '-':<8} {n.gateway or '-'}"
    )


def cmd_nodes(args: argparse.Namespace) -> int:
    with _client(args) as c:
        nodes = c.nodes()
    header = (
        f"{'NODE':<14} {'POD':<10} {'ROLE':<6} {'HEALTH':<8} {'AGENT':<22} {'LAST SEEN':<11} "
        f"{'GPUS':<5} {'UTIL':>5} {'TOK/S':>8} {'TP':<8} {'ENGINE':<9} {'WEIGHTS':<8} GATEWAY"
    )
    _print(args, nodes, lambda: "\n".join([header, *(_node_row(n) for n in nodes)]))
    return 0


def topology_json(t: Any) -> dict[str, Any]:
    """The JSON of `topology show`: the wiring as the proto names it, and the committed
    state with the names and spelling of `phase get` (``epoch`` a number, ``phase`` as
    `phase set` takes it or null, circuits as ``ocs``, ``a``, ``b``, ``pod_a``, ``pod_b``)."""
    from google.protobuf import json_format

    def plain(messages: Any) -> list[dict[str, Any]]:
        return [
            json_format.MessageToDict(
                m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            for m in messages
        ]

    phase = optional_phase_from_pb(t.phase)
    return {
        "cluster": t.cluster,
        "pods": plain(t.pods),
        "nodes": plain(t.nodes),
        "tors": plain(t.tors),
        "ocses": plain(t.ocses),
        "epoch": t.epoch,
        "phase": None if phase is None else phase.value,
        "circuits": to_json(_circuit_views(t.circuits)),
    }


def _circuit_views(circuits: Any) -> list[CircuitView]:
    return [CircuitView(x.ocs, x.port_a, x.port_b, x.pod_a, x.pod_b) for x in circuits]


def cmd_topology(args: argparse.Namespace) -> int:
    with _client(args) as c:
        t = c.topology()
    if getattr(args, "json", False):
        print(json.dumps(topology_json(t), indent=2, sort_keys=True))
        return 0
    circuits = _circuit_views(t.circuits)
    lines = [f"cluster {t.cluster}: {len(t.pods)} pods, {len(t.nodes)} nodes, epoch {t.epoch}"]
    for p in t.pods:
        uplinks = sum(len(tor.uplinks) for tor in t.tors if tor.pod == p.name)
        lines.append(
            f"  pod {p.name:<10} role {p.role:<5} nodes {', '.join(p.nodes)}; "
            f"ToRs {', '.join(p.tors) or '-'} ({uplinks} OCS uplinks)"
        )
    for o in t.ocses:
        lines.append(
            f"  OCS {o.name}: {o.port_count} ports, switching {_ms(o.switching_time_s)}, "
            f"at {o.address}"
        )
    lines.append(f"circuits ({len(circuits)}):")
    lines += _by_pair(circuits) or ["  none"]
    print("\n".join(lines))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    if args.recent < 0 or args.count < 0:
        raise errors.field_error("--recent/--count", min(args.recent, args.count), "N >= 0")
    seen = 0
    with _client(args) as c:
        for e in c.watch(args.recent, args.follow):
            if getattr(args, "json", False):
                print(json.dumps(to_json(e), sort_keys=True), flush=True)
            else:
                when = time.strftime("%H:%M:%S", time.localtime(e.timestamp))
                where = e.node or (f"epoch {e.epoch}" if e.epoch else "")
                stages = f" [{_stages(e.stages)}]" if e.stages else ""
                print(f"{when} #{e.sequence} {e.kind:<16} {where}  {e.message}{stages}", flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    return 0


def describe_schedule(s: ScheduleView) -> str:
    lines = [s.explanation]
    changes = [x for x in s.layouts if x["before"] != x["after"]]
    if s.layouts:
        lines.append(
            f"layouts ({len(s.layouts)} generation nodes, {s.requests} requests"
            f"{', ' + str(len(changes)) + ' changing' if changes else ''}):"
        )
        for x in s.layouts:
            before = "+".join(f"TP{t}" for t in x["before"])
            after = "+".join(f"TP{t}" for t in x["after"])
            lines.append(
                f"  {x['node']:<14} {before}" + (f" -> {after}" if after != before else "")
            )
    if s.planned_at:
        when = time.strftime("%H:%M:%S", time.localtime(s.planned_at))
        state = "carried out" if s.acted else "not carried out (nothing to do, or waiting)"
        lines.append(f"planned at {when} ({s.mode}); {state}")
    if s.actions:
        lines.append(f"last actions ({len(s.actions)}):")
        for a in s.actions[-10:]:
            when = time.strftime("%H:%M:%S", time.localtime(a["timestamp"]))
            mark = "ok    " if a["ok"] else "FAILED"
            lines.append(
                f"  {when} {mark} {a['kind']:<8} {a['node']}: {a['message']} ({a['seconds']:.2f} s)"
            )
    return "\n".join(lines)


def cmd_schedule(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.action in ("pause", "resume"):
            s = c.pause_schedule(args.action == "pause")
        else:
            s = c.schedule()
    _print(args, s, lambda: describe_schedule(s))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    w = wiring_mod.load(args.file)
    data = wiring_mod.to_dict(w)
    _print(args, data, lambda: _describe_wiring(w, data))
    return 0


def _describe_wiring(w: Any, data: dict[str, Any]) -> str:
    lines = [f"{w.source}: valid wiring for cluster {w.cluster!r} (controller {w.controller})"]
    for o in data["ocs"]:
        how = ""
        if o.get("driver") == "netconf":
            n = o["netconf"]
            cred = n.get("key_file") or n.get("password_file")
            how = f" (NETCONF over SSH as {n['username']}, credentials {cred})"
        lines.append(
            f"  ocs {o['name']}: {o['ports']} ports, {o['switching_time_ms']} ms, "
            f"at {o['address']}{how}"
        )
    for p in data["pod"]:
        lines.append(f"  pod {p['name']} ({p['role']}): nodes {', '.join(p['nodes'])}")
    for t in data["tor"]:
        ports = ", ".join(f"{u['port']}->{u['ocs']}:{u['ocs_port']}" for u in t["uplinks"])
        lines.append(f"  tor {t['name']} (pod {t['pod']}): uplinks {ports or 'none'}")
    for n in data["node"]:
        lines.append(
            f"  node {n['name']} (pod {n['pod']}, {n['role']}): {n['gpus']} GPUs, "
            f"{len(n['nics'])} NICs, agent {n['agent']}"
        )
    return "\n".join(lines)


def cmd_local(args: argparse.Namespace) -> int:
    as_json = getattr(args, "json", False)
    if args.action == "up":
        cluster = local.up(
            args.wiring,
            args.run_dir,
            ephemeral_ports=args.ephemeral_ports,
            progress=(lambda m: None) if as_json else (lambda m: print(m, flush=True)),
            engine=local_engine(args),
            ha=args.ha,
            ocs=args.ocs,
        )
        _print(
            args,
            cluster,
            lambda: (
                f"local cluster up: controller at {cluster.controller}\n"
                f"  export ORL_CONTROLLER={cluster.controller}\n"
                f"  Prometheus /metrics of every daemon: `orlctl local status`\n"
                f"  logs in {cluster.run_dir}/logs; stop with `orlctl local down`"
            ),
        )
    elif args.action == "down":
        report = local.down(args.run_dir)
        _print(
            args,
            {"stopped": report},
            lambda: "\n".join(report) if report else f"no local cluster in {args.run_dir}",
        )
    else:
        found, alive = local.status(args.run_dir)
        if found is None:
            _print(args, {"running": False}, lambda: f"no local cluster in {args.run_dir}")
            return 1
        # an HA group: who leads, as each controller answers now
        roles = local.controller_roles(found) if "," in found.controller else {}
        rows = [
            {**to_json(p), "alive": alive[p.pid]}
            | ({"ha_role": roles[p.name]} if p.role == "controller" and p.name in roles else {})
            for p in found.procs
        ]
        _print(
            args,
            {"running": any(alive.values()), "controller": found.controller, "procs": rows},
            lambda: "\n".join(
                [f"controller {found.controller}; run dir {found.run_dir}"]
                + [
                    f"  {r['role']:<10} {r['name']:<14} pid {r['pid']:<8} "
                    f"{'running' if r['alive'] else 'EXITED':<8} {r['address']:<21}"
                    + (f" metrics http://{r['metrics']}/metrics" if r["metrics"] else "")
                    + (f" {r['ha_role']}" if "ha_role" in r else "")
                    for r in rows
                ]
            ),
        )
        return 0 if all(alive.values()) else 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fabric_controller.demo import run_demo

    if not 1 <= args.steps <= 100:
        raise errors.field_error("--steps", args.steps, "an integer from 1 to 100")
    return run_demo(args.wiring, args.steps, args.run_dir)


def cmd_demo_engines(args: argparse.Namespace) -> int:
    from fabric_controller.demo_engines import DemoConfig, run_demo_engines

    if not 1 <= args.requests <= 16:
        raise errors.field_error("--requests", args.requests, "an integer from 1 to 16")
    if not 16 <= args.max_tokens <= 4000:
        raise errors.field_error("--max-tokens", args.max_tokens, "an integer from 16 to 4000")
    cfg = DemoConfig(
        args.engine,
        args.engine_command,
        args.requests,
        args.max_tokens,
        args.equal_lengths,
        run_dir=args.run_dir,
    )
    return run_demo_engines(cfg, as_json=getattr(args, "json", False))


def cmd_demo_rl(args: argparse.Namespace) -> int:
    from fabric_controller.demo_rl import RLConfig, run_demo_rl

    given = {
        "engine": args.engine,
        "command": args.engine_command,
        "steps": args.steps,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "learning_rate": args.lr,
        "seed": args.seed,
        "rollout": args.rollout,
        "over_provision": args.over_provision,
        "max_staleness": args.max_staleness,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "target_length": args.target_length,
        "ramble": args.ramble,
        "length_weight": args.length_weight,
        "seats": args.seats,
        "mode": args.mode,
        "in_flight": args.in_flight,
        "run_dir": args.run_dir,
        "plot": args.plot,
    }
    cfg = RLConfig(**{k: v for k, v in given.items() if v is not None})
    return run_demo_rl(cfg, as_json=getattr(args, "json", False))


def cmd_certs(args: argparse.Namespace) -> int:
    from orchestrrl.devcerts import make_dev_pki

    bad = [n for n in args.names if not wiring_mod.NAME_RE.match(n)]
    if bad:
        raise errors.field_error("names", bad[0], wiring_mod.NAME_RULE)
    try:
        files = make_dev_pki(args.out, args.names)
    except ImportError:
        raise errors.FailedPrecondition(
            "`orlctl certs dev` needs the cryptography package: pip install 'orchestrrl[certs]'"
        ) from None
    rows = {n: {"cert": str(f.cert), "key": str(f.key), "ca": str(f.ca)} for n, f in files.items()}
    _print(
        args,
        rows,
        lambda: "\n".join(
            [f"wrote a throwaway CA and {len(files)} certificate(s) to {args.out}:"]
            + [f"  {n}: {r['cert']} {r['key']}" for n, r in rows.items()]
        ),
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    args.action = "plan"
    return cmd_phase(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "phase": cmd_phase,
    "mode": cmd_mode,
    "plan": cmd_plan,
    "nodes": cmd_nodes,
    "topology": cmd_topology,
    "schedule": cmd_schedule,
    "events": cmd_events,
    "config": cmd_config,
    "local": cmd_local,
    "demo-engines": cmd_demo_engines,
    "demo-rl": cmd_demo_rl,
    "demo": cmd_demo,
    "certs": cmd_certs,
}


@contextlib.contextmanager
def _logs_on_stderr() -> Iterator[None]:
    """orlctl's own log lines (the client following the leader of an HA group) go to
    stderr, warnings and worse: stdout holds the results (--json). The caller's logging
    is restored afterwards (main also runs in-process, in tests)."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging("warning", "console", sys.stderr)
    try:
        yield
    finally:
        structlog.configure(**config)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        for handler in [h for h in handlers if h not in root.handlers]:
            root.addHandler(handler)
        root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _logs_on_stderr():
            return COMMANDS[args.command](args)
    except errors.OrlError as exc:
        if getattr(args, "json", False):
            kind = type(exc).__name__
            print(json.dumps({"error": {"kind": kind, "message": str(exc)}}, indent=2))
        print(f"orlctl: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, errors.InvalidArgument) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `orlctl events --follow | head`: the reader went away
        # Python would report the failed flush of stdout at exit: point it at /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
