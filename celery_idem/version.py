"""The package's version.

In a module of its own: ``celery_idem.contrib.otel`` names its meter with it, and importing the
package root for it (whose seam names load ``celery_idem.task``) from a module the seam loads
would close an import cycle.
"""

__version__ = "0.1.0"
