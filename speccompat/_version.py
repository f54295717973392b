"""The version of speccompat (a leaf: the package and its worker side read it from here)."""

__version__ = "0.2.0"
