"""Races against a real database: several threads, each on its own connection, released together."""

from __future__ import annotations

import threading
from typing import Callable

from django.db import connection


def race(work: Callable[[int], None], threads: int, *, what: str = "a thread") -> list[BaseException]:
    """Run ``work(index)`` in ``threads`` threads, each with its own connection (closed after),
    started together by a barrier; the exceptions they raised. Fails when one hangs."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            connection.ensure_connection()
            barrier.wait(timeout=30)
            work(index)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not any(worker.is_alive() for worker in workers), f"{what} hung"
    return errors
