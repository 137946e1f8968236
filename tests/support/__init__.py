"""What every test folder shares: the pytest plugin (``plugin.py``, registered by ``tests/conftest.py``) with the
fixtures, and the plain helpers test modules import (``servers.py``: the real processes; ``models.py``: small
models and rows). Test modules import from here, never from another test module or a conftest."""
