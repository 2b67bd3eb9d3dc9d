"""Settings of the benchmarks' processes: the project's settings plus ``bench.counting``.

``bench.counting`` registers the ``bench_counted`` job type (a ``noop`` that also counts its
executions in Redis, so a benchmark can prove that no job was lost or run twice) and, when
``BENCH_COUNT_URL`` names a Redis database, counts every SQL statement and transaction the
process runs (see ``bench/counting/__init__.py``). Nothing of the application changes.
"""

from orchestrator_site.settings import *  # noqa: F401,F403
from orchestrator_site.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench.counting"]
