"""Fleet tests use the shared fixtures (``tests/support/plugin.py``): READY versions made by the real ONNX
preparation path, and host agents run as real processes with real tritonservers, talking to the test's live
server over the agent API."""
