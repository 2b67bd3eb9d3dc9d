"""``export_run RUN [--output FILE] [--validate]``: the run's sidecar (seed 002 §5) as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import CommandError

from core.management.base import RunbookCommand, positive_id
from runs.models import Run
from runs.pipeline.sidecar import sidecar_build, sidecar_schema


class Command(RunbookCommand):
    help = ("Print (or write to --output) a run's sidecar: phases with their gate invariants, approvals, "
            "idempotency keys, context pins, last error; schema_version 1 (runs/sidecar.schema.json).")

    def add_arguments(self, parser):
        parser.add_argument("run", type=positive_id, metavar="RUN", help="run id")
        parser.add_argument("--output", "-o", metavar="FILE", help="write the JSON to FILE instead of stdout")
        parser.add_argument("--validate", action="store_true",
                            help="check the document against the sidecar JSON Schema first (needs jsonschema)")

    def handle(self, *args, **options):
        run = Run.objects.filter(pk=options["run"]).first()
        if run is None:
            raise CommandError(f"run {options['run']} does not exist")
        document = sidecar_build(run)
        if options["validate"]:
            try:
                import jsonschema
            except ImportError as exc:
                raise CommandError("--validate needs the jsonschema package") from exc
            errors = sorted(jsonschema.Draft202012Validator(sidecar_schema()).iter_errors(document), key=str)
            if errors:
                raise CommandError("the sidecar does not match its schema: "
                                   + "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
                                               for e in errors[:5]))
        text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
        if options["output"]:
            try:
                Path(options["output"]).write_text(text)
            except OSError as exc:
                raise CommandError(f"cannot write {options['output']}: {exc}") from exc
            self.stdout.write(f"run {run.pk}: sidecar written to {options['output']}")
        else:
            self.stdout.write(text, ending="")
