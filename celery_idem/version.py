"""The package's version, in a module of its own so contrib.otel reads it without a cycle."""

__version__ = "0.1.0"
