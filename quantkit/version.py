"""quantkit's version: the one place it is written (pyproject.toml reads it; a release: CHANGELOG.md). A module of
its own, below every other, so that the package's modules read it without importing the Python API
(`quantkit/__init__.py`)."""

__version__ = "0.2.0"
