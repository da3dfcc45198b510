"""Add-ons built on the core's public names: agent tools, MCP, sagas, the CLI, maintenance, Flower,
OpenTelemetry, Django, Redis Cluster and Sentinel.

Each module here imports only public names of the core (``celery_idem.app``, ``gate``,
``stores``, ...); see ``docs/architecture.md``.
"""
