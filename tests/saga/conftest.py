"""Fixtures: real workers (Redis) from the integration suite and a real payments provider."""

from tests.fencing.conftest import provider  # noqa: F401  (fixture)
from tests.integration.conftest import cluster, make_cluster  # noqa: F401  (fixtures)
