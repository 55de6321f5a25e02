"""pytest set-up for bench/ (not collected by the default run: setup.cfg's testpaths is tests/).

bench/ is not a package: put it on sys.path so the suite imports ``baseline`` and ``run`` from here."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
