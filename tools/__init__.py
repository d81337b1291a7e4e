"""Development tools run from a checkout (``python -m tools.NAME`` in the repository root); not
installed with the package."""
