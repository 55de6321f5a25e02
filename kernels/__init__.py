"""Triton kernels of flowrl; installed as ``flowrl.kernels`` (see setup.cfg ``package_dir``).

In a checkout this folder is also reachable as a top-level ``kernels`` whenever the checkout's root is
on ``sys.path`` (``python -m ...`` or ``python -c ...`` run there). That name belongs to the ``kernels``
distribution (Hugging Face's, a dependency of transformers >= 5.25, which imports it): such an
import is handed on to that package, or fails as a missing module, as it would outside the checkout.
"""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (this checkout's kernels/ is flowrl.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file
    _spec.loader.exec_module(_module)
