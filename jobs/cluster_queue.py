"""The queue between a django-q2 cluster's pusher and its workers, safe against ``kill -9``.

django-q2 hands tasks to its worker processes through a ``multiprocessing.Queue``. An idle
worker waits inside ``Queue.get()`` *holding the queue's read lock*, the other idle workers
wait for that lock. If the waiting worker is killed (``kill -9``, the OOM killer), the lock
is never released: the reincarnated workers and every other worker block on it forever, the
pusher blocks once the queue is full, and the cluster stops executing anything while each
process still looks alive (django-q2 issue #23).

``TaskQueue.get()`` waits for data *without* the lock and takes the lock only to read a task
that is already there (a bounded wait of ``LOCKED_WAIT_S``), so a worker killed while idle
leaves the queue usable. ``install()`` makes django-q2's cluster build its queues from it.
"""

from __future__ import annotations

import queue
import time

from django_q.queues import Queue

IDLE_POLL_S = 0.5  # how long one wait for data lasts before it starts again (no lock held)
LOCKED_WAIT_S = 0.05  # the longest a reader holds the lock waiting for a task another took


class TaskQueue(Queue):
    def get(self, block: bool = True, timeout: float | None = None):
        if not block:
            return super().get(False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise queue.Empty
            wait = IDLE_POLL_S if remaining is None else min(IDLE_POLL_S, remaining)
            if not self._reader.poll(wait):  # several readers may wait here together
                continue
            try:
                return super().get(True, LOCKED_WAIT_S)
            except queue.Empty:
                continue  # another reader took it


def install() -> None:
    """Build django-q2's task and result queues from ``TaskQueue`` (before a cluster starts)."""
    import django_q.cluster

    django_q.cluster.Queue = TaskQueue
