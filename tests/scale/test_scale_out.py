"""The one-machine scale-out (``python -m deploy.scale_out``): two clusters and two daphnes at work."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest
from rest_framework.authtoken.models import Token

from core.models import Event
from deploy.clients import EventClients
from deploy.stack import descendants, free_port
from jobs.models import TERMINAL_JOB_STATES, Job, JobState
from jobs.services import job_enqueue
from runs.models import Run
from tests.conftest import make_plan
from tests.processes import BASE_DIR, REDIS_TEST_URL, flush_redis, redis_available, wait_for, worker_env

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.skipif(not redis_available(), reason=f"needs Redis at REDIS_TEST_URL ({REDIS_TEST_URL}): "
                                                     "the clusters share its broker"),
]


class ScaleOut:
    """``python -m deploy.scale_out`` as a child process; knows the pids it printed."""

    def __init__(self, tmp_path, ports):
        # No worker is killed here: a long lease, so a slow heartbeat on a busy machine never
        # hands a job to a second worker (that recovery path is the drills' business).
        env = worker_env(REDIS_URL=REDIS_TEST_URL, ORCHESTRATOR_Q_NAME="scale-out",
                         ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY=4, ORCHESTRATOR_QUEUE_LEASE_S=60)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deploy.scale_out", "--ports", ",".join(map(str, ports)),
             "--log-dir", str(tmp_path / "logs")],
            cwd=BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.lines: list[str] = []
        self.clusters: list[int] = []
        self.webs: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            if match := re.match(r"qcluster \d+\s+pid (\d+)", line):
                self.clusters.append(int(match[1]))
            elif match := re.match(r"daphne \d+\s+pid (\d+)", line):
                self.webs.append(int(match[1]))
            elif line.startswith("Ready."):
                return
        self.process.kill()
        raise AssertionError("scale_out did not get ready:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise
        self.lines += self.process.stdout.read().splitlines()
        return code


def api(port: int, token: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/{path}", method="POST",
                                     data=json.dumps(body or {}).encode(),
                                     headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_clusters_share_the_jobs_and_both_daphnes_stream_every_event(org_factory, tmp_path, monkeypatch, settings):
    # Wake messages from this process would go to its own (ORM) broker: the deployment's
    # maintenance pump wakes its workers through Redis instead.
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 100_000
    flush_redis()
    _, project, owner = org_factory(credits=100_000)
    token = Token.objects.create(user=owner).key
    ports = [free_port(), free_port()]
    start_id = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    deployment = ScaleOut(tmp_path, ports)
    clients = None
    workers: dict[int, set[int]] = {0: set(), 1: set()}  # cluster → its worker pids, seen over time
    try:
        assert (len(deployment.clusters), len(deployment.webs)) == (2, 2), deployment.lines
        clients = EventClients([f"ws://127.0.0.1:{port}/ws/events/" for port in ports], token,
                               [{"project": project.pk}, {"project": project.pk}], after=start_id).start()
        assert [client.urls[client.url_index] for client in clients.clients] == \
               [f"ws://127.0.0.1:{port}/ws/events/" for port in ports]  # one client on each daphne

        probes = []
        for batch in range(20):
            probes += [job_enqueue(job_type="probe", project=project,
                                   payload={"value": batch * 15 + n, "sleep": 0.02}).job.pk for n in range(15)]
            time.sleep(0.05)
        runs = []
        for number in range(4):  # created and started through either daphne
            port = ports[number % 2]
            run = api(port, token, "runs/", {"project": project.pk, "name": f"scaled {number}",
                                             "plan": make_plan(agents=3, tasks=2, steps=2)})
            api(ports[(number + 1) % 2], token, f"runs/{run['id']}/start/")
            runs.append(run["id"])

        def settled():
            for index, pid in enumerate(deployment.clusters):
                workers[index] |= descendants(pid)
            return (Run.objects.filter(pk__in=runs, status=Run.Status.COMPLETED).count() == len(runs)
                    and not Job.objects.exclude(state__in=list(TERMINAL_JOB_STATES)).exists())

        wait_for(settled, timeout=180, interval=0.3, message="every job terminal and every run completed")
        end_id = Event.objects.order_by("-id").values_list("id", flat=True).first()
        wait_for(lambda: clients.caught_up({0: end_id, 1: end_id}), timeout=60, message="both clients caught up")
    finally:
        if clients is not None:
            clients.stop()
        code = deployment.stop()
    assert code == 0, deployment.lines
    assert "stopped" in deployment.lines
    every_pid = set(deployment.clusters) | set(deployment.webs) | workers[0] | workers[1]
    # Ctrl-C stopped everything (killed processes may take a moment to go).
    wait_for(lambda: not [pid for pid in every_pid if alive(pid)], timeout=30, message="every process gone")

    def cluster_of(worker: str) -> int:
        pid = int(worker.rsplit(":", 1)[1])
        return next((index for index, pids in workers.items() if pid in pids), None)  # None: a worker we never saw

    # Jobs spread over both clusters, each executed exactly once.
    executions = list(Event.objects.filter(type="job_probe_executed").values_list("payload__jobId", "payload__worker"))
    assert Counter(job_id for job_id, _ in executions) == Counter(probes)
    assert Job.objects.filter(pk__in=probes, state=JobState.COMPLETED).count() == len(probes)
    by_cluster = Counter(cluster_of(worker) for _, worker in executions)
    assert set(by_cluster) == {0, 1}, by_cluster  # every executing worker was one of the two clusters
    started = Counter(Event.objects.filter(type="orchestrator_job_started").values_list("payload__jobId", flat=True))
    assert set(started.values()) == {1}  # no job was claimed twice
    run_jobs = Job.objects.filter(run_id__in=runs)
    assert {cluster_of(worker) for worker in run_jobs.values_list("worker", flat=True)} == {0, 1}

    # A client on either daphne saw every event of the project, in order, once; so every event
    # of each run, whichever cluster executed it.
    expected = list(Event.objects.filter(project_id=project.pk, id__gt=start_id, id__lte=end_id)
                    .order_by("id").values_list("id", flat=True))
    for client in clients.clients:
        assert [i for i in client.ids() if i <= end_id] == expected, (client.index, client.errors[-3:])
    for run_id in runs:
        run_events = list(Event.objects.filter(run_id=run_id).order_by("id").values_list("id", flat=True))
        assert run_events and Event.objects.filter(run_id=run_id, type="run_completed").exists()
        for client in clients.clients:
            assert [event["id"] for event in client.events if event["run"] == run_id] == run_events
