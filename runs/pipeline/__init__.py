"""Gated pipelines (DESIGN §4, seed 002): what a gated run has beyond an ordinary run.

- ``bookkeeping``: phases, the running clock, pins recorded, phase keys, receipts and drift
  records (called by the run services under the run's lock; changes no status).
- ``checks``: the registered checks of ``check`` steps (``ledger_balanced``, ``file_digest``, ...).
- ``pins``: pin providers, recording and recomputing pins, drift.
- ``gates``: how the engine executes ``check`` and ``approval`` steps.
- ``caps``: soft caps per phase and the run's hard cap, enforced on running time.
- ``sidecar``: the seed's JSON sidecar of a run (``export_run``, the API, the run page).
- ``admin``: the run page's pipeline panels and forms.

The services that change a gated run's state (approve, acknowledge drift, resume, stop on a cap)
live with the other run services in ``runs.services``.
"""
