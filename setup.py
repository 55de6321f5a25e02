"""The package list, found rather than listed by hand (a hand list once left flowrl.losses out of the
wheel): every package under flowrl/, and kernels/ (a top-level folder of the checkout) installed as
``flowrl.kernels`` with any subpackage it grows. Metadata and dependencies live in setup.cfg."""
from setuptools import find_packages, setup

KERNELS = "kernels"

setup(
    package_dir={"flowrl": "flowrl", "flowrl.kernels": KERNELS},
    packages=find_packages(include=["flowrl", "flowrl.*"])
    + ["flowrl." + name for name in find_packages(include=[KERNELS, KERNELS + ".*"])],
)
