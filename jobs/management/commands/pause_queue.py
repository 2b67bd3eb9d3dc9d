"""``pause_queue --project ID | --job-type TYPE --reason TEXT``: the queue runbook ``pause_queue``."""

from jobs.runbooks import queue_command

Command = queue_command("pause_queue")
