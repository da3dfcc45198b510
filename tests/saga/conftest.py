"""Fixtures: real workers (Redis) from the integration suite, a real payments provider, and the
unit tests' eager app on the in-process store."""

from tests.fencing.conftest import provider  # noqa: F401  (fixture)
from tests.integration.conftest import cluster, make_cluster  # noqa: F401  (fixtures)
from tests.unit.test_task import app  # noqa: F401  (fixture: an eager app on memory://)
