"""The fake pyACL moved to ``backend_ge.fakes.pyacl`` (``npu-check --fake`` needs it at run time); this name
keeps the tests' imports working."""

from backend_ge.fakes.pyacl import *  # noqa: F403
from backend_ge.fakes.pyacl import FakeAcl, write_fake_om  # noqa: F401
