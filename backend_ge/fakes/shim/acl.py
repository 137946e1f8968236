"""FAKE pyACL as the module ``acl``, for tritonserver's python stubs under ``npu-check --fake`` and tests.

One ``FakeAcl`` runtime per process (8 devices, like the fake host). Importing it without ``GE_FAKES=1``
fails, exactly as on a host without CANN, so a stray PYTHONPATH never serves through the fake.
"""

import os

if os.environ.get("GE_FAKES") != "1":
    raise ImportError(
        "this is the platform's FAKE pyACL (backend_ge/fakes/shim); it loads only with GE_FAKES=1"
    )

from backend_ge.fakes import FAKE_HOST_DEVICES  # noqa: E402
from backend_ge.fakes.pyacl import FakeAcl  # noqa: E402

FAKE = True
_runtime = FakeAcl(device_count=FAKE_HOST_DEVICES)


def __getattr__(name):
    return getattr(_runtime, name)
