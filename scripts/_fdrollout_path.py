"""Finds the `fdrollout` package for the old script names (fdpublish.py, safetensors_np.py).

First a checkout's python/ (beside scripts/), then an install prefix's
lib/python3*/dist-packages (these scripts are installed in share/fdrollout/python/), else
whatever python3's own path holds.
"""
import glob
import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def module(name):
    """fdrollout.<name>, imported from wherever the package is found."""
    candidates = [os.path.join(_here, "..", "python")] + sorted(
        glob.glob(os.path.join(_here, "..", "..", "..", "lib", "python3*", "dist-packages")))
    for p in candidates:
        if os.path.isfile(os.path.join(p, "fdrollout", "__init__.py")):
            sys.path.insert(0, os.path.abspath(p))
            break
    return importlib.import_module("fdrollout." + name)
