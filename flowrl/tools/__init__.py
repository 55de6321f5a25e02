"""flowrl's developer tools, run from a checkout: ``python -m flowrl.tools.aot`` (the kernels' AOT compile and roofline)."""
