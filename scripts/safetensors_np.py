"""Shim: the safetensors reader/writer moved into the `fdrollout` package (python/fdrollout/safetensors_np.py).

Kept so `sys.path.insert(0, "scripts"); import safetensors_np` and the installed
share/fdrollout/python/safetensors_np.py keep working; new code should `from fdrollout import safetensors_np`.
`import safetensors_np` returns that module itself.
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

import fdrollout.safetensors_np  # noqa: E402

sys.modules[__name__] = fdrollout.safetensors_np
