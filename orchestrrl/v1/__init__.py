"""The protobuf/gRPC stubs of proto/orchestrrl/v1, generated at build time (setup.py,
``make proto``) and not committed. This file is committed: setuptools finds the
packages before it builds them, so the package must exist before its stubs do."""
