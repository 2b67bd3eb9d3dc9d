"""WSGI entry point (management tooling; the console itself is served by daphne)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator_site.settings")

application = get_wsgi_application()
