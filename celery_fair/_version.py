"""The release, in one place (the package root and the commands read it)."""

__version__ = "0.1.0"
