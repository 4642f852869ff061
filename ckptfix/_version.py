"""The package version (the ground: every folder may import it)."""

__version__ = "0.1.0"
