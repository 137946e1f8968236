"""The platform's one settings module. Every deployment-specific value comes from the environment.

Embedded default (no variables set, ``DEBUG=1``): SQLite and Celery's filesystem transport under
``var/``, so ``make run`` needs no external service. Production sets ``DATABASE_URL``,
``CELERY_BROKER_URL``, ``SECRET_KEY``, ``ALLOWED_HOSTS`` and leaves ``DEBUG`` off.

Every variable read here is declared in ``serving_platform.config_reference`` (type, default, minimum,
meaning) and read through ``serving_platform.env``'s helpers, which take its default from there: add a
variable to that list first. The documentation's configuration reference is generated from it.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from serving_platform.env import address_of_bind, env_bool, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("VAR_DIR") or BASE_DIR / "var").resolve()
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("DEBUG")


def _secret_key() -> str:
    key = env_str("SECRET_KEY")
    if key:
        return key
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is required when DEBUG is off; set SECRET_KEY (50+ random characters), "
            "or DEBUG=1 for the embedded development default"
        )
    # Generated once and kept, so sessions survive restarts of the embedded default. Created 0600: it is
    # never readable, even for a moment, by another user (Triton's servers run as other users).
    # `make run` starts web, worker and beat at once: the key is written whole under a private name and
    # linked into place, so a process that loses the race reads the winner's key, never an empty file.
    key_file = VAR_DIR / "secret_key"
    if not key_file.exists():
        draft = VAR_DIR / f".secret_key.{os.getpid()}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(64))
        try:
            os.link(draft, key_file)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "axes",
    "apps.core",
    "apps.teams",
    "apps.audit",
    "apps.registry",
    "apps.conversions",
    "apps.fleet",
    "apps.deployments",
    "apps.monitoring",
    "apps.gateway",
    "apps.alerts",
    "frontend",
]

MIDDLEWARE = [
    # First: it times the whole request, including the other middleware.
    "apps.monitoring.platform_metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    # Before the CSRF check, which parses a form body: a body over its view's limit is refused unread.
    "apps.core.body_limits.BodyLimitMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last: answers a sign-in refused by the lockout (AUTHENTICATION_BACKENDS) with AXES_LOCKOUT_CALLABLE.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "serving_platform.urls"
WSGI_APPLICATION = "serving_platform.wsgi.application"
ASGI_APPLICATION = "serving_platform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "frontend.context_processors.navigation",
            ],
        },
    },
]

# --- Database ---------------------------------------------------------------------------------
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}",
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE"),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not memory: tests start workers and agents as separate processes that share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test-db.sqlite3")}
    # The embedded default has five processes writing (web, worker, beat, agent threads): WAL lets readers
    # and one writer work at once, IMMEDIATE transactions take the write lock up front instead of failing
    # half-way, and writers wait for each other instead of raising "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Sign-in throttling (django-axes): wrong passwords for one username, or from one address, lock further
# sign-ins of that username / from that address for a while. API tokens never pass through these backends.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: a locked-out sign-in is refused before the password check
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT")
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LOGIN_LOCKOUT_MINUTES"))
# The address is REMOTE_ADDR. Behind a reverse proxy every client has the proxy's address, and locking it
# would lock everyone: set LOGIN_LOCK_BY_ADDRESS=0 there (usernames are still locked).
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"] if env_bool("LOGIN_LOCK_BY_ADDRESS") else ["username"]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "frontend.views.sign_in_locked"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

# --- Single sign-on (OpenID Connect, mozilla-django-oidc; apps.teams.oidc and apps.teams.sso) ------------
# Off unless OIDC_ISSUER is set. Endpoints and keys come from the issuer's discovery document; the
# authorization code flow always sends state, nonce and a PKCE challenge, and checks them on the way back.
OIDC_ISSUER = env_str("OIDC_ISSUER").strip()
OIDC_ENABLED = bool(OIDC_ISSUER)
OIDC_PROVIDER_NAME = env_str("OIDC_PROVIDER_NAME")  # the button says "Sign in with ..."
OIDC_RP_CLIENT_ID = env_str("OIDC_CLIENT_ID")
OIDC_RP_CLIENT_SECRET = env_str("OIDC_CLIENT_SECRET")
OIDC_RP_SCOPES = env_str("OIDC_SCOPES")
OIDC_RP_SIGN_ALGO = env_str("OIDC_SIGN_ALGO")
# Team membership and role from one claim: values "<prefix><team slug>:<role>", e.g. "tgp:vision:maintainer".
OIDC_GROUPS_CLAIM = env_str("OIDC_GROUPS_CLAIM")
OIDC_GROUP_PREFIX = env_str("OIDC_GROUP_PREFIX")
OIDC_USERNAME_CLAIM = env_str("OIDC_USERNAME_CLAIM")
# How far the ID token's exp/iat may be off from this machine's clock; bounded so a typo cannot turn the
# expiry check off.
OIDC_CLOCK_SKEW_S = env_int("OIDC_CLOCK_SKEW_S")
OIDC_TIMEOUT = env_int("OIDC_TIMEOUT_S")
OIDC_USE_PKCE = True
OIDC_USE_NONCE = True
OIDC_AUTHENTICATION_CALLBACK_URL = "sso-callback"
# Off: the password form is gone and passwords are refused (API tokens still work).
LOCAL_SIGN_IN = env_bool("LOCAL_SIGN_IN")
if OIDC_ENABLED:
    if not (OIDC_RP_CLIENT_ID and OIDC_RP_CLIENT_SECRET):
        raise ImproperlyConfigured(
            "OIDC_ISSUER is set: OIDC_CLIENT_ID and OIDC_CLIENT_SECRET are required too"
        )
    AUTHENTICATION_BACKENDS.append("apps.teams.oidc.PlatformOIDCBackend")
elif not LOCAL_SIGN_IN:
    raise ImproperlyConfigured("LOCAL_SIGN_IN=0 needs single sign-on: set OIDC_ISSUER (and its client) too")
if not LOCAL_SIGN_IN:
    AUTHENTICATION_BACKENDS.remove("django.contrib.auth.backends.ModelBackend")

# --- Static files: our own under frontend/static, third-party ones from npm (frontend/node_modules) ---
STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)
_NODE_MODULES = BASE_DIR / "frontend" / "node_modules"
STATIC_MANIFEST = env_bool("STATIC_MANIFEST", not DEBUG)
# The platform image holds the collected copy (STATIC_ROOT) and no node_modules: the finders' sources are needed
# only where files are collected or served from the checkout.
STATICFILES_DIRS = (
    [
        ("vendor/htmx", _NODE_MODULES / "htmx.org" / "dist"),
        ("vendor/pico", _NODE_MODULES / "@picocss" / "pico" / "css"),
        ("vendor/swagger-ui", _NODE_MODULES / "swagger-ui-dist"),
        ("vendor/uplot", _NODE_MODULES / "uplot" / "dist"),
    ]
    if _NODE_MODULES.is_dir() or not STATIC_MANIFEST
    else []
)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if STATIC_MANIFEST
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        )
    },
}
# Serve straight from the finders when there is no collectstatic step (embedded default, tests).
WHITENOISE_USE_FINDERS = not STATIC_MANIFEST

# --- Artifacts ------------------------------------------------------------------------------------
ARTIFACT_ROOT = Path(env_str("ARTIFACT_ROOT") or VAR_DIR / "artifacts").resolve()
# Largest model upload accepted (bytes); archives may unpack to twice that.
UPLOAD_MAX_BYTES = env_int("UPLOAD_MAX_BYTES")
# Archive bombs: an upload archive may hold at most this many members and unpack to at most this many bytes.
UPLOAD_ARCHIVE_MAX_MEMBERS = env_int("UPLOAD_ARCHIVE_MAX_MEMBERS")
UPLOAD_ARCHIVE_MAX_UNPACKED_BYTES = env_int("UPLOAD_ARCHIVE_MAX_UNPACKED_BYTES", 2 * UPLOAD_MAX_BYTES)

# --- Playground: one inference from the web UI or the API, run inside a web worker ------------------
# Largest request body (JSON or multipart with .npy files) and most input values per request, so one
# request cannot grow a web worker by more than a few hundred MiB.
PLAYGROUND_MAX_BYTES = env_int("PLAYGROUND_MAX_BYTES")
PLAYGROUND_MAX_ELEMENTS = env_int("PLAYGROUND_MAX_ELEMENTS")

# --- Fleet: the platform's side of the agent API ----------------------------------------------------
# The host agent is a program of its own (`python -m hostagent --help` lists its options and their
# environment variables); nothing here configures it.
# Long poll (apps.fleet.long_poll): an agent asks the platform to hold its poll (its FLEET_LONG_POLL_WAIT s,
# 0: short polls); the platform grants at most AGENT_LONG_POLL_MAX_WAIT s and reads the waiting hosts'
# generations every AGENT_LONG_POLL_WATCH_MS. A held poll pins one of a web process's WEB_THREADS threads, so
# one process holds at most AGENT_LONG_POLL_MAX_WAITERS (the rest is answered at once, as a short poll): the
# UI and the API keep threads of their own.
AGENT_LONG_POLL_MAX_WAIT = env_int("AGENT_LONG_POLL_MAX_WAIT")
AGENT_LONG_POLL_WATCH_MS = env_int("AGENT_LONG_POLL_WATCH_MS")
WEB_THREADS = env_int("WEB_THREADS")
AGENT_LONG_POLL_MAX_WAITERS = env_int("AGENT_LONG_POLL_MAX_WAITERS", max(0, WEB_THREADS - 16))
# The database connections one web process shares among its threads (a pool in serving_platform.wsgi): at most
# this many requests run in Django at once, so hundreds of threads for held polls do not open hundreds of
# PostgreSQL connections.
WEB_DATABASE_CONNECTIONS = env_int("WEB_DATABASE_CONNECTIONS")

# --- Security (checked by `manage.py check --deploy`) ---------------------------------------------
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Load balancers probe health over plain HTTP inside the private network.
# Prometheus scrapes /metrics the same way.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
if env_bool("SECURE_PROXY_SSL_HEADER"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
X_FRAME_OPTIONS = "DENY"

# --- REST API -------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.teams.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "apps.core.pagination.OrderedPageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]
    + (["rest_framework.renderers.BrowsableAPIRenderer"] if DEBUG else []),
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "apps.core.exceptions.api_exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Triton GE serving platform API",
    "DESCRIPTION": "Teams, tokens, models, conversions, deployments and metrics of the serving platform.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI from npm (frontend/package.json), not from a CDN: the platform often runs air-gapped.
    "SWAGGER_UI_DIST": STATIC_URL + "vendor/swagger-ui",
    "SWAGGER_UI_FAVICON_HREF": STATIC_URL + "vendor/swagger-ui/favicon-32x32.png",
    # The common error responses (401/403/404/400/413) of every operation, declared in one place.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "apps.core.schema.declare_error_responses",
    ],
    # Several models have a `state`; name each choice set after its model instead of a hash.
    "ENUM_NAME_OVERRIDES": {
        "VersionStateEnum": "apps.registry.models.VersionState",
        "UploadStateEnum": "apps.registry.models.UploadState",
        "JobStateEnum": "apps.conversions.models.JobState",
        "InstanceStateEnum": "apps.fleet.models.InstanceState",
        "DeploymentStateEnum": "apps.deployments.models.DeploymentState",
        "PlacementStateEnum": "apps.deployments.models.PlacementState",
        "RolloutStateEnum": "apps.deployments.models.RolloutState",
        "PriorityClassEnum": "apps.core.priority.CHOICES",
        "TuningStateEnum": "apps.deployments.tuning_models.TuningState",
        "TuningAdviceStateEnum": "apps.monitoring.retune.ADVICE_STATES",
    },
}

API_TOKEN_LAST_USED_RESOLUTION = timedelta(minutes=1)
# How long a team invitation can be accepted.
TEAM_INVITATION_DAYS = env_int("TEAM_INVITATION_DAYS")

# --- Celery -----------------------------------------------------------------------------------------
CONVERSION_TIME_LIMIT = env_int("CONVERSION_TIME_LIMIT")
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or "filesystem://"
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND") or f"file://{VAR_DIR / 'celery' / 'results'}"
_broker_scheme = urlsplit(CELERY_BROKER_URL).scheme
# A task unacknowledged for longer than this is handed to another worker (acks_late): it must outlast
# the longest job or a slow conversion would run twice.
CELERY_BROKER_TRANSPORT_OPTIONS: dict = {
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", CONVERSION_TIME_LIMIT + 3600)
}
# A RUNNING conversion whose worker has not written its heartbeat for this long is taken to be dead: a
# redelivered or re-enqueued copy may claim it (apps.conversions.tasks.recover_stale_conversions).
CONVERSION_HEARTBEAT_TIMEOUT = env_int("CONVERSION_HEARTBEAT_TIMEOUT")
# Broker messages, results and beat's schedule are the platform's alone.
(VAR_DIR / "celery").mkdir(mode=0o700, exist_ok=True)
(VAR_DIR / "celery").chmod(0o700)
if _broker_scheme == "filesystem":
    _broker_dir = VAR_DIR / "celery" / "broker"
    for _sub in ("queue", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS.update(
        data_folder_in=str(_broker_dir / "queue"),
        data_folder_out=str(_broker_dir / "queue"),
        processed_folder=str(_broker_dir / "processed"),
        control_folder=str(_broker_dir / "control"),
        store_processed=False,
    )
if CELERY_RESULT_BACKEND.startswith("file://"):
    Path(CELERY_RESULT_BACKEND.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {"apps.conversions.tasks.*": {"queue": "conversions"}}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_EXPIRES = timedelta(days=1)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celery" / "beat-schedule")
# Whatever the broker: beat dies at start when its schedule's directory is missing (a fresh VAR_DIR).
Path(CELERY_BEAT_SCHEDULE_FILENAME).parent.mkdir(parents=True, exist_ok=True)
CELERY_BEAT_SCHEDULE = {
    "prune-audit-events": {
        "task": "apps.audit.tasks.prune_audit_events",
        "schedule": timedelta(hours=6),
    },
    "expire-abandoned-uploads": {
        "task": "apps.registry.tasks.expire_abandoned_uploads",
        "schedule": timedelta(hours=1),
    },
    "recover-stale-conversions": {
        "task": "apps.conversions.tasks.recover_stale_conversions",
        "schedule": timedelta(minutes=1),
        # Housekeeping: must not wait behind long conversions on their own queue.
        "options": {"queue": "default"},
    },
}
AUDIT_RETENTION_DAYS = env_int("AUDIT_RETENTION_DAYS")

# --- Scheduler (apps.deployments.scheduler): replicas placed by capacity, replaced when a host is lost ----
# A host unheard of for longer is lost: its replicas are placed elsewhere in its pool.
SCHEDULER_HOST_GRACE_S = env_int("SCHEDULER_HOST_GRACE_S")
SCHEDULER_MAX_REPLICAS = env_int("SCHEDULER_MAX_REPLICAS")
SCHEDULER_TICK_S = env_int("SCHEDULER_TICK_S")
SCHEDULER_EVICTION_MIN_IDLE_S = env_int("SCHEDULER_EVICTION_MIN_IDLE_S")
SCHEDULER_EVICTION_HEADROOM_MB = env_int("SCHEDULER_EVICTION_HEADROOM_MB")
# --- Tuning jobs (apps.deployments.tuning_jobs): placed, swept and timed out by the scheduler's tick ------
TUNING_QUEUE_TIMEOUT_S = env_int("TUNING_QUEUE_TIMEOUT_S")
TUNING_REPORT_GRACE_S = env_int("TUNING_REPORT_GRACE_S")
TUNING_MAX_BUDGET_S = env_int("TUNING_MAX_BUDGET_S")
CELERY_BEAT_SCHEDULE["scheduler-tick"] = {
    "task": "apps.deployments.tasks.scheduler_tick",
    "schedule": timedelta(seconds=SCHEDULER_TICK_S),
    # A tick older than its interval is superseded by the next one.
    "options": {"queue": "default", "expires": SCHEDULER_TICK_S},
}
# --- Autoscaling (apps.deployments.autoscaling, fed by apps.gateway.autoscaling) -------------------------
# How often the gateway's in-flight requests are read and each autoscaled deployment's replicas decided.
AUTOSCALE_TICK_S = env_int("AUTOSCALE_TICK_S")
CELERY_BEAT_SCHEDULE["autoscale"] = {
    "task": "apps.gateway.tasks.autoscale",
    "schedule": timedelta(seconds=AUTOSCALE_TICK_S),
    "options": {"queue": "default", "expires": AUTOSCALE_TICK_S},
}
UPLOAD_ABANDON_AFTER_HOURS = env_int("UPLOAD_ABANDON_AFTER_HOURS")

# --- Monitoring: Triton scraping, rollups, the platform's own /metrics -----------------------------
METRICS_SCRAPE_INTERVAL = env_int("METRICS_SCRAPE_INTERVAL")
METRICS_SCRAPE_TIMEOUT = env_int("METRICS_SCRAPE_TIMEOUT")
# Minute rows become hourly rows after this many days; every row is dropped after the retention.
METRICS_MINUTE_RETENTION_DAYS = env_int("METRICS_MINUTE_RETENTION_DAYS")
METRICS_RETENTION_DAYS = env_int("METRICS_RETENTION_DAYS")
# /metrics answers a Bearer METRICS_TOKEN, or else only these client addresses.
METRICS_TOKEN = env_str("METRICS_TOKEN")
METRICS_ALLOWED_IPS = env_list("METRICS_ALLOWED_IPS")
CELERY_BEAT_SCHEDULE.update(
    {
        "scrape-triton-metrics": {
            "task": "apps.monitoring.tasks.scrape_instances",
            "schedule": timedelta(seconds=METRICS_SCRAPE_INTERVAL),
            # A scrape older than its interval is stale: the next one supersedes it.
            "options": {"queue": "default", "expires": METRICS_SCRAPE_INTERVAL},
        },
        "downsample-metrics": {
            "task": "apps.monitoring.tasks.downsample_metrics",
            "schedule": timedelta(minutes=30),
            "options": {"queue": "default"},
        },
    }
)

# --- Inference gateway: HAProxy in front of every Triton instance (apps.gateway) ------------------
GATEWAY_BIND = env_str("GATEWAY_BIND")
GATEWAY_GRPC_BIND = env_str("GATEWAY_GRPC_BIND")
# HAProxy's Prometheus exporter; the platform scrapes it (keep it private).
GATEWAY_STATS_BIND = env_str("GATEWAY_STATS_BIND")
GATEWAY_METRICS_URL = (
    env_str("GATEWAY_METRICS_URL")
    or f"http://{address_of_bind('GATEWAY_STATS_BIND', GATEWAY_STATS_BIND)}/metrics"
)
# What users copy into their clients (snippets, deployment API, README); TLS terminates here in production.
# Each follows its bind unless set (a wildcard bind gives localhost: set these for clients on other machines).
GATEWAY_PUBLIC_URL = (
    env_str("GATEWAY_PUBLIC_URL") or f"http://{address_of_bind('GATEWAY_BIND', GATEWAY_BIND)}"
)
GATEWAY_PUBLIC_GRPC = env_str("GATEWAY_PUBLIC_GRPC") or address_of_bind(
    "GATEWAY_GRPC_BIND", GATEWAY_GRPC_BIND
)
GATEWAY_DIR = Path(env_str("GATEWAY_DIR") or VAR_DIR / "gateway").resolve()
GATEWAY_HAPROXY = env_str("GATEWAY_HAPROXY")
GATEWAY_THREADS = env_int("GATEWAY_THREADS")
GATEWAY_SYNC_INTERVAL_MS = env_int("GATEWAY_SYNC_INTERVAL_MS")
GATEWAY_ACTIVATION_TIMEOUT_S = env_int("GATEWAY_ACTIVATION_TIMEOUT_S")
GATEWAY_DRAIN_TIMEOUT_S = env_int("GATEWAY_DRAIN_TIMEOUT_S")
GATEWAY_ROUTES_STALE_S = env_int("GATEWAY_ROUTES_STALE_S")
GATEWAY_WAKE_POLL_MS = env_int("GATEWAY_WAKE_POLL_MS")
GATEWAY_CHECK_INTERVAL_MS = env_int("GATEWAY_CHECK_INTERVAL_MS")
# HAProxy's buffer (tune.bufsize). Larger buffers cost CPU per request (HAProxy copies the buffer for retries)
# and memory per connection; a gRPC message streams through it whatever its size (grpc.lua walks it).
GATEWAY_BUFFER_BYTES = env_int("GATEWAY_BUFFER_BYTES")
GATEWAY_GRPC_MAX_MESSAGE_BYTES = env_int("GATEWAY_GRPC_MAX_MESSAGE_BYTES")
GATEWAY_SERVER_MAXCONN = env_int("GATEWAY_SERVER_MAXCONN")
# Deployments (and rollout canaries) take pre-declared backend slots at run time; the pool grows by this many,
# with a graceful reload, only when every slot is taken.
GATEWAY_SLOT_CHUNK = env_int("GATEWAY_SLOT_CHUNK")
# Team.quota_requests_per_second of a new team.
GATEWAY_DEFAULT_REQUESTS_PER_SECOND = env_int("GATEWAY_DEFAULT_REQUESTS_PER_SECOND")

# --- Progressive rollouts (apps.deployments.rollouts) ---------------------------------------------
# How often beat looks for rollout checks that are due (each check claims its rollout, so two beats are safe).
ROLLOUT_TICK_MS = env_int("ROLLOUT_TICK_MS")
# An ended rollout's canary is unloaded this long after its weight went to 0: the gateway syncs first.
ROLLOUT_UNLOAD_DELAY_S = env_int("ROLLOUT_UNLOAD_DELAY_S")
# Bounds of a rollout's step interval a user may choose (tests use 2 s).
ROLLOUT_MIN_INTERVAL_S = env_int("ROLLOUT_MIN_INTERVAL_S")
ROLLOUT_MAX_INTERVAL_S = env_int("ROLLOUT_MAX_INTERVAL_S")
CELERY_BEAT_SCHEDULE["check-rollouts"] = {
    "task": "apps.deployments.tasks.check_rollouts",
    "schedule": timedelta(milliseconds=ROLLOUT_TICK_MS),
    "options": {"queue": "default", "expires": max(1.0, ROLLOUT_TICK_MS / 1000)},
}

# --- Alerts and notifications (apps.alerts) -------------------------------------------------------
# Links in notifications (generatorURL, the email's page link) start with this; it follows the web process's
# bind (WEB_BIND, as the Procfile reads it) unless set.
WEB_BIND = env_str("WEB_BIND")
PLATFORM_PUBLIC_URL = env_str("PLATFORM_PUBLIC_URL") or f"http://{address_of_bind('WEB_BIND', WEB_BIND)}"
# Webhook URLs are tenant input: loopback/private/link-local destinations only when this is on (DEBUG, tests).
ALERT_WEBHOOK_ALLOW_PRIVATE = env_bool("ALERT_WEBHOOK_ALLOW_PRIVATE", DEBUG)
ALERT_WEBHOOK_TIMEOUT = env_int("ALERT_WEBHOOK_TIMEOUT")
ALERT_DELIVERY_MAX_RETRIES = env_int("ALERT_DELIVERY_MAX_RETRIES")
# Seconds before the first retry; doubles each time (capped at 10 min), with jitter.
ALERT_DELIVERY_RETRY_BACKOFF = env_int("ALERT_DELIVERY_RETRY_BACKOFF")
ALERT_MAX_RULES_PER_TEAM = env_int("ALERT_MAX_RULES_PER_TEAM")
ALERT_MAX_CHANNELS_PER_TEAM = env_int("ALERT_MAX_CHANNELS_PER_TEAM")
ALERT_MAX_SILENCE_DAYS = env_int("ALERT_MAX_SILENCE_DAYS")
# Email notifications: Django's mail backend (the console in development, SMTP otherwise).
_DEFAULT_EMAIL_BACKEND = "console" if DEBUG else "smtp"
EMAIL_BACKEND = env_str("EMAIL_BACKEND") or f"django.core.mail.backends.{_DEFAULT_EMAIL_BACKEND}.EmailBackend"
EMAIL_HOST = env_str("EMAIL_HOST")
EMAIL_PORT = env_int("EMAIL_PORT")
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS")
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT")
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL")
CELERY_BEAT_SCHEDULE["evaluate-alert-rules"] = {
    "task": "apps.alerts.tasks.evaluate_alert_rules",
    "schedule": timedelta(minutes=1),
    # A late evaluation is superseded by the next minute's.
    "options": {"queue": "default", "expires": 55},
}

# --- Demo account created by `manage.py bootstrap_demo` (make run) ---------------------------------
DEMO_USERNAME = env_str("DEMO_USERNAME")
DEMO_PASSWORD = env_str("DEMO_PASSWORD")
DEMO_TEAM = env_str("DEMO_TEAM")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL")},
}
