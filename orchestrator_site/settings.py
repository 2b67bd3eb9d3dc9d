"""Settings for Orchestrator Console, read from the environment.

With nothing set the project runs on SQLite (WAL journal, IMMEDIATE transactions and a busy
timeout so concurrent writers wait instead of failing) with django-q2's ORM broker.
``DATABASE_URL=postgres://...`` switches to PostgreSQL (psycopg 3, persistent connections with
health checks); ``REDIS_URL`` switches the django-q2 broker to Redis.
Every variable is documented in the README.
"""

import os
import secrets
import tempfile
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:  # fail loudly at start-up, never later
        raise RuntimeError(f"environment variable {name} must be an integer, got {raw!r}") from exc


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def secret_key_kept(path: Path) -> str:
    """The key stored in ``path``; made (random, mode 0600) by the first process that needs it.

    The key is written to a temporary file and linked into place without overwriting, then
    read back: processes starting together (daphne, qcluster, a test's workers) all end up
    with the one key that won.
    """
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".secret_key.")  # mode 0600
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(secrets.token_urlsafe(64) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, path)
            except FileExistsError:
                pass  # another process was first: use its key
        finally:
            os.unlink(temporary)
        key = path.read_text().strip()
    if len(key) < 50:
        raise RuntimeError(f"{path} holds no usable secret key: delete it (a new one is made) or set DJANGO_SECRET_KEY")
    return key


# No key in the code: DJANGO_SECRET_KEY, or one generated once and kept in var/secret_key.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "").strip() or secret_key_kept(
    Path(env_str("DJANGO_SECRET_KEY_FILE", str(BASE_DIR / "var" / "secret_key"))))
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

# Served over HTTPS (usually by a TLS proxy in front of daphne): cookies only over HTTPS, HSTS,
# plain HTTP redirected, and the proxy's X-Forwarded-Proto trusted to say a request came over
# HTTPS (the proxy must set it, overwriting what the client sent).
HTTPS = env_bool("DJANGO_HTTPS", False)
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
SECURE_SSL_REDIRECT = HTTPS
SECURE_HSTS_SECONDS = env_int("DJANGO_HSTS_SECONDS", 31_536_000) if HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_HSTS_PRELOAD", True)
_PROXY_SSL_HEADER = env_str("DJANGO_PROXY_SSL_HEADER", "X-Forwarded-Proto").strip()
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https") if HTTPS and _PROXY_SSL_HEADER else None)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_q",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "channels",
    "core",
    "billing",
    "jobs",
    "runs",
    "diagnosis",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "orchestrator_site.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "orchestrator_site.wsgi.application"
ASGI_APPLICATION = "orchestrator_site.asgi.application"

# --- Database -------------------------------------------------------------------------------
SQLITE_PATH = Path(env_str("ORCHESTRATOR_SQLITE_PATH", str(BASE_DIR / "var" / "db.sqlite3")))
DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
DB_CONN_MAX_AGE = env_int("DB_CONN_MAX_AGE", 600)

# 0: persistent per-thread connections (workers: django-q2 forks, and a pool must not cross a
# fork). > 0: a per-process psycopg pool, for daphne, where each request may run in another
# thread (run_console sets it for its daphne child).
DB_POOL_MAX_SIZE = env_int("DB_POOL_MAX_SIZE", 0)

if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL)}
    if DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql") and DB_POOL_MAX_SIZE > 0:
        DATABASES["default"]["CONN_MAX_AGE"] = 0
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1, "max_size": DB_POOL_MAX_SIZE, "timeout": 30, "max_idle": 300,
        }
    else:
        DATABASES["default"]["CONN_MAX_AGE"] = DB_CONN_MAX_AGE
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    if DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql"):
        # The ORM's cursors bind on the client and are never prepared; the queue's hot statements
        # (claim, completion: jobs.services) bind on the server and are prepared by psycopg once
        # they ran this many times on a connection (0 or less: never).
        _prepare_threshold = env_int("DB_PREPARE_THRESHOLD", 5)
        DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = (
            _prepare_threshold if _prepare_threshold > 0 else None)
else:
    SQLITE_PATH.parent.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": SQLITE_PATH,
            "CONN_MAX_AGE": DB_CONN_MAX_AGE,
            "OPTIONS": {
                # Writers take the write lock when the transaction begins, so two writers
                # wait for each other (busy timeout) instead of failing on lock upgrade.
                "transaction_mode": "IMMEDIATE",
                "timeout": env_int("ORCHESTRATOR_SQLITE_BUSY_TIMEOUT_S", 30),
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file, not memory: tests start real worker processes that share the database.
            # One file per test session, so concurrent sessions never share it.
            "TEST": {"NAME": env_str("ORCHESTRATOR_SQLITE_TEST_PATH",
                                     str(SQLITE_PATH.parent / f"test_db_{os.getpid()}.sqlite3"))},
        }
    }

DATABASE_IS_POSTGRES = DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql")

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# Serve the apps' static files even before (or without) collectstatic: a fresh checkout's console
# and the browser tests get the admin's CSS and our live scripts.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "admin:login"

# --- Orchestrator: runs (DESIGN §2) ---------------------------------------------------------
ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = env_int("ORCHESTRATOR_RUN_PENDING_TIMEOUT_S", 24 * 3600)
ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S = env_int("ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S", 24 * 3600)
ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = env_int("ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S", 60)
ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S = env_int("ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S", 7 * 24 * 3600)
ORCHESTRATOR_RUN_RESUMING_TIMEOUT_S = env_int("ORCHESTRATOR_RUN_RESUMING_TIMEOUT_S", 5 * 60)
ORCHESTRATOR_RUN_RETRYING_TIMEOUT_S = env_int("ORCHESTRATOR_RUN_RETRYING_TIMEOUT_S", 24 * 3600)
# Off: the reaper leaves silent and orphaned running runs to operators (the demo does this).
ORCHESTRATOR_RUN_AUTO_RECOVER = env_bool("ORCHESTRATOR_RUN_AUTO_RECOVER", True)
ORCHESTRATOR_ARTIFACT_TTL_DAYS = env_int("ORCHESTRATOR_ARTIFACT_TTL_DAYS", 30)
ORCHESTRATOR_MAX_AGENTS = env_int("ORCHESTRATOR_MAX_AGENTS", 10)
# How long one run_step job goes on with the next runnable step of its run (begun in the
# transaction that settled the last) before it leaves the rest to new jobs; 0: one step a job.
ORCHESTRATOR_RUN_STEP_CHAIN_MS = env_int("ORCHESTRATOR_RUN_STEP_CHAIN_MS", 2000)
# The size of a plan (runs/plan.py): agents in it (not max_agents, the agents running at once),
# tasks of one agent, steps of one task, steps in all. A plan over a cap is refused as a whole.
ORCHESTRATOR_PLAN_MAX_AGENTS = env_int("ORCHESTRATOR_PLAN_MAX_AGENTS", 50)
ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT = env_int("ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT", 200)
ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK = env_int("ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK", 100)
ORCHESTRATOR_PLAN_MAX_STEPS = env_int("ORCHESTRATOR_PLAN_MAX_STEPS", 5000)
for _cap in ("AGENTS", "TASKS_PER_AGENT", "STEPS_PER_TASK", "STEPS"):
    if globals()[f"ORCHESTRATOR_PLAN_MAX_{_cap}"] < 1:
        raise RuntimeError(f"ORCHESTRATOR_PLAN_MAX_{_cap} must be at least 1")
# Outbound HTTP of the http_request tool and the http_ok check (runs/http_fetch.py): entries are
# "host" (any port), "host:port", an IP address or "[v6]:port". Empty: no outbound call at all.
# A loopback, private, link-local ... address is reached only when an IP entry names it.
ORCHESTRATOR_HTTP_ALLOWED_HOSTS = env_list("ORCHESTRATOR_HTTP_ALLOWED_HOSTS", [])
ORCHESTRATOR_HTTP_MAX_REDIRECTS = env_int("ORCHESTRATOR_HTTP_MAX_REDIRECTS", 3)
ORCHESTRATOR_HTTP_MAX_RESPONSE_BYTES = env_int("ORCHESTRATOR_HTTP_MAX_RESPONSE_BYTES", 256 * 1024)
# Files file_digest checks and file_sha256 pins may read (the default directory is created when
# first needed; it holds neither the database nor the artifacts), and the largest they hash.
ORCHESTRATOR_PIPELINE_FILE_ROOTS = env_list("ORCHESTRATOR_PIPELINE_FILE_ROOTS",
                                            [str(BASE_DIR / "var" / "pipeline-files")])
ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES = env_int("ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES", 256 * 1024 * 1024)

# --- Billing (DESIGN §2.3) --------------------------------------------------------------------
# Key of the ledger's HMAC-SHA256 hash chain. Empty: derived from SECRET_KEY when an entry is
# hashed (billing/chain.py), never here. Changing it makes check_invariants flag every entry.
ORCHESTRATOR_LEDGER_HMAC_KEY = env_str("ORCHESTRATOR_LEDGER_HMAC_KEY", "")

# --- Logs ----------------------------------------------------------------------------------------
# One JSON object per line (core/logging.py), or text. Every state transition is an INFO record
# of "orchestrator.transitions" with entity, <entity>_id, project_id, run_id, type, attempt,
# from, to and reason.
LOG_FORMAT = env_str("LOG_FORMAT", "json").strip().lower()
if LOG_FORMAT not in ("json", "text"):
    raise RuntimeError(f"LOG_FORMAT must be json or text, got {LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "core.logging.JsonFormatter"}, "text": {"()": "core.logging.TextFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
    "loggers": {
        "orchestrator.transitions": {"level": env_str("ORCHESTRATOR_TRANSITION_LOG_LEVEL", "INFO")},
    },
}

# --- Artifacts (files runs produce) ---------------------------------------------------------------
# Kept in the "artifacts" storage; deleted by the prune once expired. Reading one pushes its expiry
# to at least ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S from now (a download in flight is not pruned).
ORCHESTRATOR_ARTIFACT_ROOT = Path(env_str("ORCHESTRATOR_ARTIFACT_ROOT", str(BASE_DIR / "var" / "artifacts")))
ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S = env_int("ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S", 3600)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "artifacts": {"BACKEND": "django.core.files.storage.FileSystemStorage",
                  "OPTIONS": {"location": str(ORCHESTRATOR_ARTIFACT_ROOT)}},
}

# --- Retention (python manage.py prune; a django-q2 schedule runs it every 10 minutes) ---------------
# Terminal jobs and events older than this many days are deleted (a project's own retention_days
# wins); ledger and audit rows are never deleted. Each prune deletes in batches for at most
# ORCHESTRATOR_RETENTION_MAX_S seconds, so a backlog drains over several runs.
ORCHESTRATOR_RETENTION_DAYS = env_int("ORCHESTRATOR_RETENTION_DAYS", 14)
ORCHESTRATOR_RETENTION_BATCH = env_int("ORCHESTRATOR_RETENTION_BATCH", 1000)
ORCHESTRATOR_RETENTION_MAX_S = env_int("ORCHESTRATOR_RETENTION_MAX_S", 60)

# --- Workers (django-q2) ---------------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "").strip()
Q_WORKERS = env_int("ORCHESTRATOR_Q_WORKERS", 2)
Q_TIMEOUT_S = env_int("ORCHESTRATOR_Q_TIMEOUT_S", 300)
Q_RETRY_S = env_int("ORCHESTRATOR_Q_RETRY_S", Q_TIMEOUT_S + 60)
Q_CLUSTER = {
    "name": env_str("ORCHESTRATOR_Q_NAME", "orchestrator"),
    "workers": Q_WORKERS,
    "timeout": Q_TIMEOUT_S,
    "retry": Q_RETRY_S,
    "max_attempts": 1,
    "ack_failures": True,
    "save_limit": env_int("ORCHESTRATOR_Q_SAVE_LIMIT", 1000),  # successful task results kept
    # A worker process is replaced after this many messages (each worker of a cluster after its own
    # count, up to ``ORCHESTRATOR_Q_RECYCLE_SPREAD`` % more: ``jobs.worker.recycle_spread``), or once
    # it has used this much memory (KB, peak resident size; 0: never).
    "recycle": env_int("ORCHESTRATOR_Q_RECYCLE", 5000),
    "max_rss": env_int("ORCHESTRATOR_Q_MAX_RSS_KB", 1_048_576) or None,
    "catch_up": False,
    "poll": 0.05,
    "label": "Django Q",
}
ORCHESTRATOR_Q_RECYCLE_SPREAD = env_int("ORCHESTRATOR_Q_RECYCLE_SPREAD", 50)
if REDIS_URL:
    Q_CLUSTER["redis"] = REDIS_URL
else:
    Q_CLUSTER["orm"] = "default"

# --- Job queue (seed 003 names and defaults) ----------------------------------------------------
ORCHESTRATOR_QUEUE_ENABLED = env_bool("ORCHESTRATOR_QUEUE_ENABLED", True)
ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = env_int("ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY", 2)
ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = env_int("ORCHESTRATOR_QUEUE_MAX_PER_PROJECT", 100)
ORCHESTRATOR_QUEUE_MAX_GLOBAL = env_int("ORCHESTRATOR_QUEUE_MAX_GLOBAL", 500)
# Per organization, so one tenant cannot starve the others (0: derived when used): waiting jobs
# (half the global cap, never below the per-project cap) and executing jobs (the whole pool,
# which a single-organization setup needs; set it below the global concurrency when tenants
# share the workers).
ORCHESTRATOR_QUEUE_ORG_MAX_WAITING = env_int("ORCHESTRATOR_QUEUE_ORG_MAX_WAITING", 0)
ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = env_int("ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING", 0)
ORCHESTRATOR_QUEUE_MAX_ATTEMPTS = env_int("ORCHESTRATOR_QUEUE_MAX_ATTEMPTS", 2)
ORCHESTRATOR_QUEUE_DEFAULT_TIMEOUT_MS = env_int("ORCHESTRATOR_QUEUE_DEFAULT_TIMEOUT_MS", 60_000)
ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = env_int("ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS", 15_000)
ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST = env_int("ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST", 3)
ORCHESTRATOR_QUEUE_LEASE_S = env_int("ORCHESTRATOR_QUEUE_LEASE_S", 15)
ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS = env_int("ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS", 1_000)
ORCHESTRATOR_QUEUE_DRAIN_MAX_JOBS = env_int("ORCHESTRATOR_QUEUE_DRAIN_MAX_JOBS", 200)
ORCHESTRATOR_QUEUE_DRAIN_MAX_S = env_int("ORCHESTRATOR_QUEUE_DRAIN_MAX_S", 10)
# Jobs a worker claims in one statement at most (a batch counts against every cap while it runs).
ORCHESTRATOR_QUEUE_CLAIM_BATCH = env_int("ORCHESTRATOR_QUEUE_CLAIM_BATCH", 32)
# A process sends at most one wake message per this many ms (jobs enqueued meanwhile share the next one).
ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = env_int("ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS", 10)
# PostgreSQL: a worker whose drain found the queue empty keeps listening this long for a job
# enqueued meanwhile (LISTEN/NOTIFY) and claims it at once, without a wake message (0: off, the
# default: every enqueue's NOTIFY then costs each listening worker's idle backend a short
# transaction of its own, which a run's step path pays about 1.4 times per step).
ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS = env_int("ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS", 0)
# A new worker process plans the claim's statements before its first message (PostgreSQL).
ORCHESTRATOR_QUEUE_WARM_AT_START = env_bool("ORCHESTRATOR_QUEUE_WARM_AT_START", True)
ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = env_int("ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS", 12_000)
ORCHESTRATOR_WORKER_SESSION_STALE_S = env_int("ORCHESTRATOR_WORKER_SESSION_STALE_S", 3600)

# --- Live events (Channels) ----------------------------------------------------------------------
# Events are delivered in-process by the relay (core/relay.py); the layer is only Channels' plumbing.
CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS = env_int("ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS", 50)

# --- API (DRF) ----------------------------------------------------------------------------------
# /api/v1/ (core/api, runs/api, jobs/api, billing/api), the OpenAPI schema at /api/schema/.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",  # first: unauthenticated → 401
        "rest_framework.authentication.SessionAuthentication",  # browser, with CSRF
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["core.api.parsers.LimitedJSONParser"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "core.api.pagination.PagePagination",
    "DEFAULT_THROTTLE_CLASSES": ["core.api.throttling.RateLimitThrottle"],
    "DEFAULT_SCHEMA_CLASS": "core.api.schema.AutoSchema",
    "EXCEPTION_HANDLER": "core.api.exceptions.api_exception_handler",
    "PAGE_SIZE": 50,
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    # The per-address limit keys on the client's address: the connection's own (0), or the one
    # the n-th trusted proxy in front of us put into X-Forwarded-For. Never a header the client
    # alone controls.
    "NUM_PROXIES": env_int("ORCHESTRATOR_TRUSTED_PROXIES", 0),
}
# The large collections (runs, jobs, ledger) page by id cursor; their ``count`` is exact up to
# this many matching rows and null beyond (counting further would read the whole table; API 1.1
# lowered the default from 10,000: a count is read on every page, and 1,000 index entries cost a
# fraction of what 10,000 do).
ORCHESTRATOR_API_COUNT_LIMIT = env_int("ORCHESTRATOR_API_COUNT_LIMIT", 1_000)
# The admin's large lists (runs, jobs, ledger, events, audit) count at most this many rows (then
# "10,000+"; the unfiltered list shows the planner's estimate on PostgreSQL) and number at most
# ORCHESTRATOR_ADMIN_MAX_PAGES pages; older rows are read by keyset ("older →" links).
ORCHESTRATOR_ADMIN_COUNT_LIMIT = env_int("ORCHESTRATOR_ADMIN_COUNT_LIMIT", 10_000)
ORCHESTRATOR_ADMIN_MAX_PAGES = env_int("ORCHESTRATOR_ADMIN_MAX_PAGES", 100)
# The dashboard counts live runs by status and stuck runs up to this many each ("1,000+" beyond),
# so that its cost does not follow the number of live runs.
ORCHESTRATOR_DASHBOARD_COUNT_LIMIT = env_int("ORCHESTRATOR_DASHBOARD_COUNT_LIMIT", 1_000)
SPECTACULAR_SETTINGS = {
    "TITLE": "Orchestrator Console API",
    "DESCRIPTION": "Runs, jobs, credits and events of the run orchestrator. Errors are "
                   "`{\"code\", \"detail\", ...}`; POSTs accept an `Idempotency-Key` header. "
                   "Changes: 1.1 — the large collections' `count` is exact up to 1,000 matching rows "
                   "(`ORCHESTRATOR_API_COUNT_LIMIT`; 10,000 before) and null beyond.",
    "VERSION": "1.1.0",
    "CONTACT": {"name": env_str("ORCHESTRATOR_API_CONTACT_NAME", "Orchestrator Console operators"),
                **({"url": env_str("ORCHESTRATOR_API_CONTACT_URL", "")}
                   if env_str("ORCHESTRATOR_API_CONTACT_URL", "") else {})},
    "SERVERS": [{"url": "/", "description": "this console (the server that serves the schema)"}],
    "TAGS": [
        {"name": "organizations", "description": "The caller's organizations (tenants)."},
        {"name": "projects", "description": "Projects of the caller's organizations; runs and jobs belong to one."},
        {"name": "runs", "description": "Runs of plans (agents → tasks → steps): create, start, pause, resume, "
                                        "cancel, retry, approve gates, events, sidecar, suggestions and explanations."},
        {"name": "escalations", "description": "Runs handed to a human: acknowledge and resolve."},
        {"name": "jobs", "description": "The job queue: enqueue (optionally waiting for the result), read, cancel."},
        {"name": "ledger", "description": "The append-only credit ledger."},
        {"name": "artifacts", "description": "Files written by runs' steps, until they expire."},
        {"name": "events", "description": "The event outbox after an id: the reconciliation feed of /ws/events/."},
        {"name": "health", "description": "Liveness of the database, broker, workers and queue (no credentials)."},
        {"name": "ping", "description": "Checks credentials."},
    ],
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SCHEMA_PATH_PREFIX": r"/api/v[0-9]+",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "runs.models.Run.Status",
        "NodeStatusEnum": "runs.models.NodeStatus",
        "EscalationStatusEnum": "runs.models.EscalationTicket.Status",
        "JobStateEnum": "jobs.models.JobState",
    },
}
# Requests per authenticated caller and per address of callers without valid credentials
# ("600/minute", "20/s"; empty: no limit) in any window of that length (a sliding window),
# counted atomically in the database or in Redis (core/ratelimit.py). Failed WebSocket token
# and /metrics token attempts count against the address's limit too, and once it is spent the
# next attempts are refused before any token is checked. The defaults leave a program room (20 requests/s sustained) and stop a
# runaway loop or a token guesser. Idempotency keys live 24 h; a request that crashed leaves its key in
# flight for at most the in-flight timeout.
ORCHESTRATOR_API_RATE = env_str("ORCHESTRATOR_API_RATE", "1200/minute")
ORCHESTRATOR_API_ANON_RATE = env_str("ORCHESTRATOR_API_ANON_RATE", "120/minute")
# Failed admin logins per username and per address in any window of that length; past either,
# the login form asks to wait and checks no password.
ORCHESTRATOR_LOGIN_USERNAME_FAILURES = env_str("ORCHESTRATOR_LOGIN_USERNAME_FAILURES", "5/15m")
ORCHESTRATOR_LOGIN_ADDRESS_FAILURES = env_str("ORCHESTRATOR_LOGIN_ADDRESS_FAILURES", "20/15m")
ORCHESTRATOR_RATE_LIMIT_STORE = env_str("ORCHESTRATOR_RATE_LIMIT_STORE", "redis" if REDIS_URL else "database")
if ORCHESTRATOR_RATE_LIMIT_STORE not in ("database", "redis") or (ORCHESTRATOR_RATE_LIMIT_STORE == "redis"
                                                                   and not REDIS_URL):
    raise RuntimeError("ORCHESTRATOR_RATE_LIMIT_STORE must be database, or redis with REDIS_URL set; "
                       f"got {ORCHESTRATOR_RATE_LIMIT_STORE!r}")
# JSON bodies (plans, job payloads) longer than this answer 413 payload_too_large.
ORCHESTRATOR_API_MAX_BODY_BYTES = env_int("ORCHESTRATOR_API_MAX_BODY_BYTES", 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = max(ORCHESTRATOR_API_MAX_BODY_BYTES, 2_621_440)
# Arrays and objects nested deeper than this in a JSON body (or a WebSocket message) are refused.
ORCHESTRATOR_JSON_MAX_DEPTH = env_int("ORCHESTRATOR_JSON_MAX_DEPTH", 32)
if not 2 <= ORCHESTRATOR_JSON_MAX_DEPTH <= 500:  # a body is an object (1) with values (2); past 500, recursion
    raise RuntimeError(f"ORCHESTRATOR_JSON_MAX_DEPTH must be from 2 to 500, got {ORCHESTRATOR_JSON_MAX_DEPTH}")
ORCHESTRATOR_IDEMPOTENCY_TTL_S = env_int("ORCHESTRATOR_IDEMPOTENCY_TTL_S", 24 * 3600)
ORCHESTRATOR_IDEMPOTENCY_IN_FLIGHT_TIMEOUT_S = env_int("ORCHESTRATOR_IDEMPOTENCY_IN_FLIGHT_TIMEOUT_S", 60)
# Job types clients may enqueue through POST /api/v1/jobs/ (the run engine's own types are not).
ORCHESTRATOR_API_JOB_TYPES = env_list("ORCHESTRATOR_API_JOB_TYPES", ["noop", "probe", "command"])
# Health: relay cursor lag (events) above which GET /api/v1/health/ answers 503.
ORCHESTRATOR_HEALTH_MAX_RELAY_LAG = env_int("ORCHESTRATOR_HEALTH_MAX_RELAY_LAG", 1000)

# --- Metrics ------------------------------------------------------------------------------------
# GET /metrics (Prometheus) answers "Authorization: Bearer <token>" with this token, or a staff
# session; empty: staff sessions only.
ORCHESTRATOR_METRICS_TOKEN = env_str("ORCHESTRATOR_METRICS_TOKEN", "")
