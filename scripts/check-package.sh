#!/usr/bin/env bash
# Build the release artefacts from what is committed, the way a packager does, and use
# them as a user would:
#   1. a clean export of HEAD (git archive: no generated stubs, no build output, nothing
#      uncommitted), built with `python -m build` (the sdist, then the wheel from the
#      sdist) with the build tools of $PY (as a distribution's packager builds);
#   2. the sdist and the wheel each installed by pip into a clean virtualenv (the sdist
#      built by pip in isolation, from the build requirements it declares), the checkout
#      off the path;
#   3. from each install, every console script: `--version`, then real work: orlctl checks
#      the installed wiring, orl-sim-ocs, orl-fabric-controller and orl-node-agent serve
#      and orlctl sets a phase through them, orl-testbed reports its state, orl-sim runs a
#      scenario.
# Prints the installed size of the base install (what a node agent needs without
# resharding). Packages come from pip's cache or the configured registry only.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=${PY:-.venv/bin/python}
# the console scripts this checks beyond --version; every one the package declares must
# be here (the install's entry points are compared with this list)
SCRIPTS=(orlctl orl-fabric-controller orl-node-agent orl-sim-ocs orl-testbed orl-sim)
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

head=$(git -C "$repo" rev-parse --short HEAD)
if [ -n "$(git -C "$repo" status --porcelain --untracked-files=normal)" ]; then
  echo "note: building HEAD ($head) as committed; uncommitted changes are not in the build"
fi
git -C "$repo" archive --format=tar --prefix=src/ HEAD | tar -x -C "$work"
"$PY" -m build --no-isolation --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
  || { tail -30 "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/*.tar.gz) && wheel=$(ls "$work"/dist/*.whl)
echo "built $(basename "$sdist") and $(basename "$wheel") from a clean export of $head"
listing=$(tar -tzf "$sdist")
for f in proto/orchestrrl/v1/fabric_controller.proto orchestrrl/v1/__init__.py LICENSE; do
  grep -q "/$f\$" <<<"$listing" || { echo "the sdist lacks $f"; exit 1; }
done
"$PY" - "$wheel" "$work"/src/proto/orchestrrl/v1/*.proto <<'EOF'
import sys, zipfile
from pathlib import Path
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
stubs = [Path(p).stem for p in sys.argv[2:]]  # one module pair per .proto
missing = [
    f"orchestrrl/v1/{s}{suffix}" for s in stubs for suffix in ("_pb2.py", "_pb2_grpc.py")
    if f"orchestrrl/v1/{s}{suffix}" not in names
]
if missing:
    raise SystemExit(f"the wheel lacks the generated stubs {missing}")
EOF

# Wait until FILE is written by the process PID (its ready file); fail with its log.
await_ready() {
  local file=$1 pid=$2 log=$3
  for _ in $(seq 600); do
    [ -s "$file" ] && return 0
    kill -0 "$pid" 2>/dev/null || { echo "it exited:"; tail -20 "$log"; return 1; }
    sleep 0.05
  done
  echo "not ready after 30 s:"; tail -20 "$log"; return 1
}

# Install ARTEFACT into a clean virtualenv and run every console script from it.
check_install() {
  local kind=$1 artefact=$2
  local venv="$work/venv-$kind" run="$work/run-$kind"
  mkdir -p "$run"
  "$PY" -m venv --without-pip "$venv"  # pip is $PY's: --python installs into the venv
  "$PY" -m pip --python "$venv/bin/python" install -q --no-compile "$artefact" >"$run/pip.log" 2>&1 \
    || { tail -30 "$run/pip.log"; return 1; }
  local bin="$venv/bin"
  cd "$run"  # the checkout is not on the path from here on
  local declared
  declared=$("$bin/python" -c 'import importlib.metadata as m
print(" ".join(sorted(e.name for e in m.distribution("orchestrrl").entry_points
                      if e.group == "console_scripts")))')
  if [ "$declared" != "$(tr ' ' '\n' <<<"${SCRIPTS[*]}" | sort | tr '\n' ' ' | sed 's/ $//')" ]; then
    echo "the package declares the console scripts: $declared; this script checks: ${SCRIPTS[*]}"
    echo "(add a check for each new one to scripts/check-package.sh)"; return 1
  fi
  local versions=()
  for script in "${SCRIPTS[@]}"; do
    versions+=("$("$bin/$script" --version)")
  done
  local wiring
  wiring=$("$bin/python" -c 'from orchestrrl.wiring import default_wiring_path as p; print(p())')
  case "$wiring" in "$venv"/*) ;; *) echo "the wiring came from $wiring, not the install"; return 1;; esac
  "$bin/orlctl" config check "$wiring" >/dev/null
  # the daemons, started by their console scripts: a switch, the controller, one agent
  "$bin/orl-sim-ocs" --listen 127.0.0.1:0 --ready-file ocs.addr --plaintext \
    --switching-time-ms 0 --log-format json 2>ocs.log &
  pids+=($!) && await_ready ocs.addr $! ocs.log
  "$bin/orl-fabric-controller" --wiring "$wiring" --state state.db --listen 127.0.0.1:0 \
    --ocs-address "ocs0=$(cat ocs.addr)" --plaintext --ready-file ctl.addr \
    --log-format json 2>ctl.log &
  pids+=($!) && await_ready ctl.addr $! ctl.log
  local controller
  controller=$(cat ctl.addr)
  "$bin/orl-node-agent" --node gen0-n0 --controller "$controller" --listen 127.0.0.1:0 \
    --engine sim --gpu-backend sim --plaintext --ready-file agent.addr \
    --log-format json 2>agent.log &
  pids+=($!) && await_ready agent.addr $! agent.log
  local phase agent_row
  phase=$("$bin/orlctl" --controller "$controller" --timeout 20 phase set training | head -1)
  agent_row=$("$bin/orlctl" --controller "$controller" --timeout 20 nodes | grep '^gen0-n0 ')
  grep -q ' up ' <<<"$agent_row" || { echo "the agent is not up: $agent_row"; return 1; }
  for pid in "${pids[@]}"; do kill -TERM "$pid"; done
  local rc
  for pid in "${pids[@]}"; do
    rc=0 && wait "$pid" || rc=$?
    [ "$rc" = 0 ] || { echo "a daemon (pid $pid) ended with exit code $rc"; return 1; }
  done
  pids=()
  local testbed simulated
  testbed=$("$bin/orl-testbed" status --id pkgchk --run-dir "$run/testbed")
  cp "$work/src/examples/sim/small.toml" small.toml
  simulated=$("$bin/orl-sim" run small.toml)
  if "$bin/python" -c 'import matplotlib' 2>/dev/null; then
    echo "the base install pulled in matplotlib (it belongs to the [sim] extra)"; return 1
  fi
  echo "from the $kind: ${#SCRIPTS[@]} console scripts run (${versions[0]}); wiring checked;"
  echo "  sim OCS + controller + agent served: 'phase set training' -> ${phase}; agent up"
  echo "  orl-testbed status: ${testbed}; orl-sim run small.toml: ${simulated##*$'\n'}"
  cd "$repo"
}

check_install sdist "$sdist"
check_install wheel "$wheel"
site=$("$work/venv-wheel/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "installed size of the base install: $(du -sm "$site" | cut -f1) MiB"
