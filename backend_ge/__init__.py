"""Everything that runs on an inference host: the Triton GE backend, its executors, config tools,
the ATC/ONNX converter, the tritonserver launcher and the load generator.

This package never imports Django: it is installed on NPU hosts next to Triton.
"""
