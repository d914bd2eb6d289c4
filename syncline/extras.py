"""PURE: the optional dependencies (``pip install 'syncline[EXTRA]'``) and the one-line
refusal naming the extra a requested feature needs.

syncline installs beside the user's own PyTorch stack, so its hard dependencies are torch and
numpy only; plots, TensorBoard and the data sets that read images, tokenizers or
scikit-learn's digits are extras. Each is imported lazily where it is used; the command line
asks :func:`require` before any process starts, so a missing package ends the command with
one line naming the extra instead of a traceback in a rank. Nothing here imports a package:
:func:`installed` only looks for it (``importlib.util.find_spec``).
"""

from __future__ import annotations

from importlib.util import find_spec

from syncline.errors import ConfigError

__all__ = ["EXTRAS", "installed", "missing_line", "require"]

#: extra -> the (import name, distribution name) pairs it installs; pyproject.toml's
#: ``[project.optional-dependencies]`` lists the same distributions
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "plot": (("matplotlib", "matplotlib"),),
    "tensorboard": (("tensorboard", "tensorboard"),),
    "data": (("sklearn", "scikit-learn"), ("PIL", "pillow"), ("tokenizers", "tokenizers")),
}


def _extra_of(module: str) -> tuple[str, str]:
    """``(extra, distribution)`` of an import name listed in :data:`EXTRAS`."""
    for extra, pairs in EXTRAS.items():
        for name, dist in pairs:
            if name == module:
                return extra, dist
    raise KeyError(f"{module!r} belongs to no extra; known: {sorted(EXTRAS)}")


def installed(module: str) -> bool:
    """Whether ``module`` (an import name) can be imported, without importing it."""
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed package is not installed
        return False


def missing_line(feature: str, module: str) -> str:
    """The one line naming what ``feature`` needs and how to install it.

    Example:
        >>> missing_line("--data digits", "sklearn")
        "--data digits needs scikit-learn, which is not installed: pip install 'syncline[data]'"
    """
    extra, dist = _extra_of(module)
    return f"{feature} needs {dist}, which is not installed: pip install 'syncline[{extra}]'"


def require(feature: str, module: str) -> None:
    """Refuse ``feature`` when ``module`` (an import name of an extra) is missing.

    Raises:
        ConfigError: one line naming the feature, the package and the extra.
    """
    if not installed(module):
        raise ConfigError(missing_line(feature, module))
