"""SQL statements of one noop job through the queue, in this process: enqueue, claim, complete.

Counts with ``django.test.utils.CaptureQueriesContext`` (``BEGIN`` and savepoints left out) over
``--jobs`` noop jobs after a warm-up, on a scratch database, and prints the mean per job and how
many of them write metric rows. Examples::

    .venv/bin/python bench/job_statements.py --sqlite
    BENCH_DATABASE_PREFIX=orch_bm .venv/bin/python bench/job_statements.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bench/ holds a queue.py: keep it off the import path so the standard library's ``queue`` is found.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench._common import django_setup, scratch_database  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sqlite", action="store_true")
    parser.add_argument("--jobs", type=int, default=20)
    args = parser.parse_args()
    scratch_database("sqlite" if args.sqlite else "postgres", "orchestrator_bench_statements")
    django_setup()
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    import jobs.wake
    from billing.services import organization_create
    from core.models import Project
    from jobs.executor import job_run_claimed
    from jobs.services import job_claim, job_enqueue

    jobs.wake._send = lambda count: None  # no broker: this process claims the jobs itself
    organization_create(name="statements", owner_username="statements-owner", credits=0)
    project = Project.objects.order_by("id").first()
    for _ in range(3):  # warm-up: caches, the claim statement built once per process
        job_enqueue(job_type="noop", project=project, payload={})
        job_run_claimed(job_claim(worker="w"), worker="w")
    totals: dict[str, int] = {}
    for _ in range(args.jobs):
        phases = []
        with CaptureQueriesContext(connection) as enqueued:
            job_enqueue(job_type="noop", project=project, payload={})
        phases.append(("enqueue", enqueued))
        with CaptureQueriesContext(connection) as claimed:
            job = job_claim(worker="w")
        phases.append(("claim", claimed))
        with CaptureQueriesContext(connection) as completed:
            job_run_claimed(job, worker="w")
        phases.append(("complete", completed))
        for name, captured in phases:
            statements = [query["sql"] for query in captured.captured_queries
                          if query["sql"] != "BEGIN" and not query["sql"].startswith(("SAVEPOINT", "RELEASE SAVEPOINT"))]
            totals[name] = totals.get(name, 0) + len(statements)
            totals[f"{name} (metric rows)"] = totals.get(f"{name} (metric rows)", 0) + sum(
                "metric" in sql.lower() for sql in statements)
    per_job = {name: count / args.jobs for name, count in totals.items()}
    print(f"{connection.vendor}, statements per noop job over {args.jobs}: "
          + ", ".join(f"{name} {count:g}" for name, count in per_job.items())
          + f"; total {sum(count for name, count in per_job.items() if '(' not in name):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
