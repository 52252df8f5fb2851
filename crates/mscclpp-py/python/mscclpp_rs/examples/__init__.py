"""Runnable examples: ``python -m mscclpp_rs.examples.<name> --help``.

- ``kv_cache``: two ranks move a torch tensor (a KV-cache block) over CUDA IPC or Ethernet.
- ``port_channel_kernel``: a kernel (compiled with NVRTC, launched with CuPy) moves data and
  signals through a PortChannel handle served by the ProxyService.
- ``bench_write``: Python-side overhead per ``Connection.write`` (Ethernet, host memory).
"""
