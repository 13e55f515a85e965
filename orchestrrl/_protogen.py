"""Generate the Python stubs of proto/orchestrrl/v1/*.proto into orchestrrl/v1/.

Run at build/install time (setup.py) and by ``make proto``; the output is not committed.
``orchestrrl/v1/__init__.py`` is: setuptools finds the packages to build before
``build_py`` runs this, so on a clean tree (or from the sdist) ``orchestrrl.v1`` is a
package only because that file is already there. Uses grpcio-tools' bundled protoc and
mypy-protobuf for typed stubs.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def generate(root: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: a build-time dependency only

    proto_root = root / "proto"
    sources = sorted((proto_root / "orchestrrl" / "v1").glob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {proto_root / 'orchestrrl' / 'v1'}")
    include = Path(protoc.__file__).parent / "_proto"
    out = root
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
    ]
    if shutil.which("protoc-gen-mypy") or _plugin_beside_python("protoc-gen-mypy"):
        args += [f"--mypy_out={out}", f"--mypy_grpc_out={out}"]
        plugin_dir = Path(sys.executable).parent
        for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc"):
            exe = shutil.which(name) or str(plugin_dir / name)
            args.append(f"--plugin={name}={exe}")
    else:
        args.append(f"--pyi_out={out}")
    args += [str(s) for s in sources]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}: {' '.join(args)}")
    pkg = root / "orchestrrl" / "v1"
    if not (pkg / "__init__.py").is_file():  # committed: missing only from a partial copy
        raise SystemExit(f"{pkg / '__init__.py'} is missing: the package's own file")
    return sorted(pkg.glob("*_pb2*.py"))


def _plugin_beside_python(name: str) -> bool:
    return (Path(sys.executable).parent / name).exists()


if __name__ == "__main__":
    for path in generate(Path(__file__).resolve().parent.parent):
        print(path)
