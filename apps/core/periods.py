"""The periods of every metrics rollup table: minute rows, which become hour rows after a retention.

Shared by the Triton rollups (``apps.monitoring``) and the gateway's (``apps.gateway``, which sits below
monitoring), so they are declared below both.
"""

MINUTE = 60
HOUR = 3600
PERIOD_CHOICES = [(MINUTE, "minute"), (HOUR, "hour")]
