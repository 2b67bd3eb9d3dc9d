"""Running the console as several processes on one machine, and drilling it.

``python -m deploy.scale_out`` starts PostgreSQL and Redis when they are not running, migrates,
and runs two ``qcluster`` processes and two daphne processes against them until Ctrl-C.
``python -m deploy.drill`` runs the reliability drills against such a deployment.
"""
