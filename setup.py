"""Build hook: generate the protobuf/gRPC stubs before packaging (they are not committed)."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).parent))
from orchestrrl._protogen import generate


class BuildWithProtos(build_py):
    def run(self) -> None:
        generate(Path(__file__).parent)
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
