"""Plug-ins the tests load as a user's would, and how a test registers one for itself."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def toy_plugin_registered() -> Iterator[ModuleType]:
    """The toy plug-in's entries registered while inside, the registries left as they were
    found after (importing the plug-in registers it, so it is imported here, not at a test
    module's collection: other tests count the built-in entries)."""
    from syncline.dp.registry import COMPRESSORS

    had = "toymean" in COMPRESSORS
    toy = importlib.import_module("tests.plugins.toy_plugin")
    toy.register()
    try:
        yield toy
    finally:
        if not had:
            toy.unregister()
