"""``resume_queue --project ID | --job-type TYPE --reason TEXT``: the queue runbook ``resume_queue``."""

from jobs.runbooks import queue_command

Command = queue_command("resume_queue")
