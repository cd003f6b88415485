"""Shim: the publishers moved into the `fdrollout` Python package (python/fdrollout/publish.py).

Kept so `sys.path.insert(0, "scripts"); import fdpublish` and the installed
share/fdrollout/python/fdpublish.py keep working; new code should `from fdrollout import publish`.
`import fdpublish` returns that module itself.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fdrollout_path  # noqa: E402

sys.modules[__name__] = _fdrollout_path.module("publish")
