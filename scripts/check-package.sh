#!/usr/bin/env bash
# Build the sdist and the wheel the way a packager does (`python -m build`: the wheel is
# built from the sdist, in isolation), install the wheel into a clean virtualenv with the
# checkout off the path, and run the console scripts from that install. Prints the
# installed size of the base install (what a node agent needs without resharding).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/*.tar.gz) && wheel=$(ls "$work"/dist/*.whl)
echo "built $(basename "$sdist") and $(basename "$wheel")"
listing=$(tar -tzf "$sdist")
for f in proto/orchestrrl/v1/fabric_controller.proto LICENSE; do
  grep -q "/$f\$" <<<"$listing" || { echo "the sdist lacks $f"; exit 1; }
done
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"
cd "$work"  # the checkout is not on the path from here on
bin="$work/venv/bin"
for script in orlctl orl-fabric-controller orl-node-agent orl-sim-ocs orl-testbed orl-sim; do
  "$bin/$script" --version
done
wiring=$("$bin/python" -c 'from orchestrrl.wiring import default_wiring_path as p; print(p())')
case "$wiring" in "$work"/venv/*) ;; *) echo "the wiring came from $wiring, not the install"; exit 1;; esac
checked=$("$bin/orlctl" config check "$wiring") && echo "${checked%%$'\n'*}"
cp "$OLDPWD/examples/sim/small.toml" "$work/small.toml"
simulated=$("$bin/orl-sim" run "$work/small.toml") && echo "orl-sim run small.toml: ${simulated##*$'\n'}"
if "$bin/python" -c 'import matplotlib' 2>/dev/null; then
  echo "the base install pulled in matplotlib (it belongs to the [sim] extra)"; exit 1
fi
site=$("$bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "installed size of the base install: $(du -sm "$site" | cut -f1) MiB ($site)"
