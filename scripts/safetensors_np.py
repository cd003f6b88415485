"""Shim: the safetensors reader/writer moved into the `fdrollout` package (python/fdrollout/safetensors_np.py).

Kept so `sys.path.insert(0, "scripts"); import safetensors_np` and the installed
share/fdrollout/python/safetensors_np.py keep working; new code should `from fdrollout import safetensors_np`.
`import safetensors_np` returns that module itself.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fdrollout_path  # noqa: E402

sys.modules[__name__] = _fdrollout_path.module("safetensors_np")
