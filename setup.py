"""The package list, found rather than listed by hand (a hand list once left flowrl.losses out of the
wheel): every package under flowrl/, and kernels/ (a top-level folder of the checkout) installed as
``flowrl.kernels`` with any subpackage it grows. Metadata and dependencies live in setup.cfg."""
import re
from pathlib import Path

from setuptools import find_packages, setup

KERNELS = "kernels"


def long_description() -> str:
    """README.md for a package index, where its relative links (docs/..., tests/...) lead nowhere: each
    becomes its text and the path it names in the source tree."""
    text = (Path(__file__).resolve().parent / "README.md").read_text(encoding="utf-8")
    return re.sub(r"\[([^\]]+)\]\((?![a-z]+://|#)([^)]+)\)", r"\1 (`\2` in the source tree)", text)


setup(
    long_description=long_description(),
    long_description_content_type="text/markdown",
    package_dir={"flowrl": "flowrl", "flowrl.kernels": KERNELS},
    packages=find_packages(include=["flowrl", "flowrl.*"])
    + ["flowrl." + name for name in find_packages(include=[KERNELS, KERNELS + ".*"])],
)
