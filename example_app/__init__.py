"""An AI-agent shop whose write tools run as ``IdempotentTask`` (see README.md in this folder).

``python -m example_app.demo`` runs naive and idempotent tools side by side against a real
HTTP provider that can fail the way real providers do.
"""
