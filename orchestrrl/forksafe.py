"""Turn off gRPC's fork handlers in our daemons, before gRPC is imported.

grpcio's core installs ``pthread_atfork`` handlers by default; in a child forked while
the parent's gRPC threads are busy they crash about one child in twenty with SIGSEGV
before it can ``exec`` (measured here: 20 of 400 ``/bin/true`` spawned by an asyncio
process serving and calling gRPC exited with -11; 0 of 400 with
``GRPC_ENABLE_FORK_SUPPORT=0``). Our daemons fork only to exec (engine servers, ``ip``,
``tc``, the local cluster's processes), so they need no handlers: an engine that failed
to start this way made a reshard fail in one run of ``make demo-engines`` in ten.

gRPC reads the variable once, when it is first imported: the daemons' packages
(``node_agent``, ``fabric_controller``, ``sim_backends``) import this module first. A
value already set (by the operator) is kept. The client library (``orchestrrl``) leaves
the environment of the program that imports it alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
