"""Triton kernels of flowrl; installed as ``flowrl.kernels`` (see setup.cfg ``package_dir``)."""
