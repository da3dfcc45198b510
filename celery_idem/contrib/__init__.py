"""Add-ons built on the core's public names: agent tools, MCP, sagas, the CLI, maintenance, Flower,
OpenTelemetry, Django.

Each module here imports only public names of the core (``celery_idem.app``, ``gate``,
``stores``, ...); see ``docs/architecture.md``. The old import paths (``celery_idem.saga``,
``celery_idem.cli``, ``celery_idem.tools``, ...) keep working as re-exports.
"""
