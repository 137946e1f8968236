"""Put on PYTHONPATH of a host agent that tests start: the platform's packages cannot be imported there.

Python imports ``sitecustomize`` at start-up. This one refuses Django, the platform's packages and what only
the platform installs, so an agent that reached for any of them fails loudly in the test that started it -
the same as on an inference host where none of them is installed.
"""

import sys
from importlib.abc import MetaPathFinder

PLATFORM_ONLY = ("django", "rest_framework", "celery", "kombu", "psycopg", "gunicorn", "apps", "serving_platform",
                 "frontend", "drf_spectacular")  # fmt: skip


class PlatformOnly(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in PLATFORM_ONLY:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not installed on an inference host)")
        return None


sys.meta_path.insert(0, PlatformOnly())
