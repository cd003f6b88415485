"""Shim: the publishers moved into the `fdrollout` Python package (python/fdrollout/publish.py).

Kept so `sys.path.insert(0, "scripts"); import fdpublish` and the installed
share/fdrollout/python/fdpublish.py keep working; new code should `from fdrollout import publish`.
`import fdpublish` returns that module itself.
"""
import os
import sys

import glob

_here = os.path.dirname(os.path.abspath(__file__))
# A checkout (python/ beside scripts/), else an install prefix (share/fdrollout/python/ -> lib/python3*/dist-packages)
# when the package is not already on python3's path.
for _p in [os.path.join(_here, "..", "python")] + sorted(glob.glob(os.path.join(_here, "..", "..", "..", "lib", "python3*", "dist-packages"))):
    if os.path.isfile(os.path.join(_p, "fdrollout", "__init__.py")):
        sys.path.insert(0, os.path.abspath(_p))
        break

import fdrollout.publish  # noqa: E402

sys.modules[__name__] = fdrollout.publish
