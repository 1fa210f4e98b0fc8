"""The package version, in one place: read by setuptools (``pyproject.toml``,
``dynamic = ["version"]``), exported as ``polygate.__version__`` and sent in the
``Hello`` frame's client name."""

__version__ = "0.2.0"
