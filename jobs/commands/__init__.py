"""The execution command boundary (seed 000, AG-EXE-01).

Every side effect goes through ``command_execute``: the command is recorded with its
idempotency key and payload hash (and committed) before the ``ExecutionAdapter`` is called;
a replay returns the recorded result, another payload under the same key is a
``CommandConflict``. Reads (``deployment_list`` ...) go to the adapter directly.

* ``jobs.commands.validation`` — command names and argument checks
* ``jobs.commands.adapters``  — the ``ExecutionAdapter`` protocol and the ``DatabaseAdapter``
* ``jobs.commands.services``  — ``command_execute``
* ``jobs.commands.selectors`` — adapter reads
* ``jobs.commands.job``       — the ``command`` job type
"""
