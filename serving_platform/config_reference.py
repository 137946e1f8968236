"""Every environment variable the platform's settings read, declared once: name, type, default, meaning.

``serving_platform.settings`` reads each of them through the typed helpers of ``serving_platform.env``, which
take the default and the minimum from here; the configuration page of the documentation is generated from
the same list (``docs/generate_reference.py``), and a test checks that settings read no
variable this list does not declare. Plain data, no Django: the documentation build imports it.

A default that settings compute from other settings (a path under ``VAR_DIR``, a value that follows
``DEBUG``) is ``DERIVED`` here: the settings module passes it, and ``default_text`` says what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

DERIVED = object()
TYPES = ("str", "path", "url", "bool", "int", "list")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its type (which helper reads it), its default and what it means."""

    name: str
    type: str
    default: object
    meaning: str
    minimum: int | None = None
    default_text: str | None = None  # how the reference shows the default; required for DERIVED
    maximum: int | None = None

    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None or self.default == "" or self.default == []:
            return "unset"
        if self.type == "bool":
            return "on" if self.default else "off"
        if self.type == "list":
            return "`" + ",".join(self.default) + "`"
        return f"`{self.default}`"


def _v(name, type_, default, meaning, minimum=None, default_text=None, maximum=None) -> Variable:
    return Variable(name, type_, default, meaning, minimum, default_text, maximum)


# Sections in the order the reference lists them; each variable in the order settings read it.
SECTIONS: dict[str, tuple[Variable, ...]] = {
    "Core": (
        _v("VAR_DIR", "path", None, "runtime state of the embedded default", default_text="`var/`"),
        _v(
            "DEBUG",
            "bool",
            False,
            "development mode; with it off, `SECRET_KEY` is required and HTTPS settings are on",
            default_text="off (`make` sets `1`)",
        ),
        _v(
            "SECRET_KEY",
            "str",
            None,
            "Django's signing key",
            default_text="generated once into `var/secret_key` when `DEBUG` is on",
        ),
        _v("ALLOWED_HOSTS", "list", ["127.0.0.1", "localhost"], "comma-separated host names"),
        _v(
            "CSRF_TRUSTED_ORIGINS",
            "list",
            [],
            "origins (scheme and host) trusted for unsafe requests behind a proxy",
        ),
        _v("LOG_LEVEL", "str", "INFO", "the root logger's level"),
    ),
    "Database": (
        _v(
            "DATABASE_URL",
            "url",
            None,
            "any dj-database-url URL",
            default_text="`sqlite:///var/db.sqlite3`",
        ),
        _v("DATABASE_CONN_MAX_AGE", "int", 60, "seconds a database connection is kept for reuse", 0),
    ),
    "Sign-in": (
        _v(
            "LOGIN_FAILURE_LIMIT",
            "int",
            5,
            "wrong passwords for one username, or from one address, that lock its sign-ins",
            1,
        ),
        _v("LOGIN_LOCKOUT_MINUTES", "int", 15, "how long a lock lasts after the last failure", 1),
        _v(
            "LOGIN_LOCK_BY_ADDRESS",
            "bool",
            True,
            "also lock by client address (`REMOTE_ADDR`); turn off behind a reverse proxy, where every client "
            "has the proxy's address",
        ),
        _v("TEAM_INVITATION_DAYS", "int", 14, "how long a team invitation can be accepted", 1),
    ),
    "Static files and uploads": (
        _v(
            "STATIC_MANIFEST",
            "bool",
            DERIVED,
            "serve collected, hashed static files (`collectstatic`); off serves them from the finders",
            default_text="on when `DEBUG` is off",
        ),
        _v("ARTIFACT_ROOT", "path", None, "where model artifacts live", default_text="`var/artifacts`"),
        _v(
            "UPLOAD_MAX_BYTES",
            "int",
            8 * 1024**3,
            "largest model upload; larger is refused with 413 (archives may unpack to twice that)",
            1,
            "`8589934592` (8 GiB)",
        ),
        _v("UPLOAD_ARCHIVE_MAX_MEMBERS", "int", 2000, "the most members an upload archive may hold", 1),
        _v(
            "UPLOAD_ARCHIVE_MAX_UNPACKED_BYTES",
            "int",
            DERIVED,
            "the most bytes an upload archive may unpack to",
            1,
            "twice `UPLOAD_MAX_BYTES`",
        ),
        _v(
            "UPLOAD_ABANDON_AFTER_HOURS",
            "int",
            48,
            "an upload nobody wrote to for this long is cancelled and its bytes deleted (hourly beat task)",
            1,
        ),
        _v(
            "PLAYGROUND_MAX_BYTES",
            "int",
            16 * 1024**2,
            "largest playground request (413 before it is read)",
            1024,
            "`16777216` (16 MiB)",
        ),
        _v(
            "PLAYGROUND_MAX_ELEMENTS",
            "int",
            4 * 1024**2,
            "most input values one playground request may build (400)",
            1,
        ),
    ),
    "Web processes and the agent API": (
        _v(
            "AGENT_LONG_POLL_MAX_WAIT",
            "int",
            30,
            "seconds the platform holds an agent's poll at most (the agent asks with its `FLEET_LONG_POLL_WAIT`)",
            1,
        ),
        _v(
            "AGENT_LONG_POLL_WATCH_MS",
            "int",
            200,
            "how often a web process reads the waiting hosts' generations",
            20,
        ),
        _v(
            "WEB_THREADS",
            "int",
            64,
            "threads of one web process (gunicorn `gthread`; read by the Procfile too, beside `WEB_WORKERS`)",
            1,
        ),
        _v(
            "AGENT_LONG_POLL_MAX_WAITERS",
            "int",
            DERIVED,
            "held polls one web process keeps at most (the rest is answered at once, as a short poll): the UI "
            "and the API keep threads of their own",
            0,
            "`WEB_THREADS` - 16",
        ),
        _v(
            "WEB_DATABASE_CONNECTIONS",
            "int",
            24,
            "database connections one web process shares among its threads: at most this many requests run "
            "in Django at once",
            1,
        ),
        _v(
            "WEB_BIND",
            "str",
            "127.0.0.1:8000",
            "where `make run`'s web process listens (read by the Procfile and by `PLATFORM_PUBLIC_URL`)",
        ),
        _v(
            "PLATFORM_PUBLIC_URL",
            "url",
            None,
            "the platform's address in notifications (links to the alerts page)",
            default_text="`http://` + the address of `WEB_BIND`",
        ),
    ),
    "HTTPS hardening (checked by `manage.py check --deploy`)": tuple(
        _v(name, "bool", DERIVED, meaning, default_text="on when `DEBUG` is off")
        for name, meaning in (
            ("SESSION_COOKIE_SECURE", "send the session cookie over HTTPS only"),
            ("CSRF_COOKIE_SECURE", "send the CSRF cookie over HTTPS only"),
            ("SECURE_SSL_REDIRECT", "redirect plain HTTP to HTTPS (health probes and `/metrics` excepted)"),
        )
    )
    + (
        _v(
            "SECURE_HSTS_SECONDS",
            "int",
            DERIVED,
            "HTTP Strict Transport Security max-age",
            0,
            "`31536000` when `DEBUG` is off, else `0`",
        ),
    )
    + tuple(
        _v(name, "bool", DERIVED, meaning, default_text="on when `DEBUG` is off")
        for name, meaning in (
            ("SECURE_HSTS_INCLUDE_SUBDOMAINS", "HSTS covers subdomains"),
            ("SECURE_HSTS_PRELOAD", "HSTS asks for browser preload lists"),
        )
    )
    + (
        _v(
            "SECURE_PROXY_SSL_HEADER",
            "bool",
            False,
            "trust `X-Forwarded-Proto: https` from a TLS proxy in front of the platform",
        ),
    ),
    "Celery and conversions": (
        _v(
            "CONVERSION_TIME_LIMIT",
            "int",
            2 * 3600,
            "the longest job, in seconds; the broker's visibility timeout is one hour longer",
            60,
        ),
        _v(
            "CELERY_BROKER_URL",
            "url",
            None,
            "Redis in production",
            default_text="`filesystem://` (under `var/celery/broker`)",
        ),
        _v(
            "CELERY_RESULT_BACKEND",
            "url",
            None,
            "Redis in production",
            default_text="`file://var/celery/results`",
        ),
        _v(
            "CELERY_VISIBILITY_TIMEOUT",
            "int",
            DERIVED,
            "Redis redelivers an unacknowledged task after this many seconds",
            1,
            "`CONVERSION_TIME_LIMIT` + 3600",
        ),
        _v(
            "CONVERSION_HEARTBEAT_TIMEOUT",
            "int",
            120,
            "seconds: a RUNNING conversion whose worker has not written its heartbeat for this long is presumed dead",
            2,
        ),
        _v("AUDIT_RETENTION_DAYS", "int", 365, "beat prunes older audit events", 1),
    ),
    "Scheduler": (
        _v(
            "SCHEDULER_HOST_GRACE_S",
            "int",
            60,
            "a host unheard of for longer is lost: its replicas are placed elsewhere in its pool",
            1,
        ),
        _v("SCHEDULER_MAX_REPLICAS", "int", 64, "the most replicas one deployment may ask for", 1),
        _v("SCHEDULER_TICK_S", "int", 5, "how often beat runs the scheduler's tick", 1),
        _v(
            "TUNING_QUEUE_TIMEOUT_S",
            "int",
            900,
            "seconds a tuning job may wait for room on an instance of its pool before it times out",
            10,
        ),
        _v(
            "TUNING_REPORT_GRACE_S",
            "int",
            120,
            "seconds past its time budget a running tuning job may go without finishing before it times out "
            "(its scratch replica's memory is released)",
            10,
        ),
        _v(
            "TUNING_MAX_BUDGET_S",
            "int",
            3600,
            "the longest time budget a tuning job may ask for",
            30,
            maximum=3600,
        ),
        _v(
            "SCHEDULER_EVICTION_MIN_IDLE_S",
            "int",
            0,
            "under memory pressure, an idle scale-to-zero replica may be evicted once it served nothing for "
            "this long even within its idle period (fewer cold starts wait for room, more replicas reload); "
            "0: only a replica that served nothing for its whole idle period",
            0,
        ),
        _v(
            "SCHEDULER_EVICTION_HEADROOM_MB",
            "int",
            0,
            "MiB the autoscaler keeps free on each instance by evicting, at every tick, what memory pressure "
            "could evict (a wake-up finds room instead of waiting ~2 s); 0: evict only when a replica needs it",
            0,
        ),
        _v(
            "AUTOSCALE_TICK_S",
            "int",
            3,
            "how often the gateway's in-flight requests are read and each autoscaled deployment's replicas decided",
            1,
        ),
    ),
    "Monitoring": (
        _v("METRICS_SCRAPE_INTERVAL", "int", 15, "seconds between beat's scrapes of the Triton instances", 1),
        _v("METRICS_SCRAPE_TIMEOUT", "int", 5, "the longest read of one instance, in seconds", 1),
        _v("METRICS_MINUTE_RETENTION_DAYS", "int", 7, "minute rows become hourly after this many days", 1),
        _v("METRICS_RETENTION_DAYS", "int", 90, "all rows go after this many days", 1),
        _v(
            "METRICS_TOKEN",
            "str",
            "",
            "a Bearer token that may read `/metrics` and `/metrics/targets.json` (see Monitoring)",
        ),
        _v(
            "METRICS_ALLOWED_IPS",
            "list",
            ["127.0.0.1", "::1"],
            "client addresses or networks that may read `/metrics` without the token (the socket address, not `X-Forwarded-For`)",
        ),
    ),
    "Inference gateway": (
        _v("GATEWAY_BIND", "str", "127.0.0.1:8080", "where the inference gateway (HAProxy) listens for HTTP"),
        _v("GATEWAY_GRPC_BIND", "str", "127.0.0.1:8081", "where the gateway listens for gRPC"),
        _v(
            "GATEWAY_STATS_BIND",
            "str",
            "127.0.0.1:8404",
            "where HAProxy's Prometheus exporter listens (keep that private)",
        ),
        _v(
            "GATEWAY_METRICS_URL",
            "url",
            None,
            "where the platform scrapes the gateway's exporter",
            default_text="`http://` + the address of `GATEWAY_STATS_BIND` + `/metrics`",
        ),
        _v(
            "GATEWAY_PUBLIC_URL",
            "url",
            None,
            "what clients are told to call over HTTP (snippets, the deployment API's `endpoints`); in "
            "production the operator's TLS endpoint",
            default_text="`http://` + the address of `GATEWAY_BIND`",
        ),
        _v(
            "GATEWAY_PUBLIC_GRPC",
            "str",
            None,
            "what gRPC clients are told to call",
            default_text="the address of `GATEWAY_GRPC_BIND`",
        ),
        _v("GATEWAY_DIR", "path", None, "the gateway's configuration and maps", default_text="`var/gateway`"),
        _v("GATEWAY_HAPROXY", "str", "haproxy", "the HAProxy executable"),
        _v("GATEWAY_THREADS", "int", 1, "HAProxy's threads (`nbthread`)", 1),
        _v(
            "GATEWAY_SYNC_INTERVAL_MS",
            "int",
            1000,
            "how often the gateway process brings all of HAProxy's maps and weights up to date (a change "
            "of one deployment syncs it alone at once; this catches what no change announces)",
            50,
        ),
        _v(
            "GATEWAY_ACTIVATION_TIMEOUT_S",
            "int",
            60,
            "how long a request for a model scaled to zero is held while a replica loads, then answered 503",
            1,
        ),
        _v(
            "GATEWAY_DRAIN_TIMEOUT_S",
            "int",
            30,
            "how long a replica told to unload waits for the gateway to confirm it sends it nothing more (its "
            "requests in flight finished) before its agent unloads it anyway",
            1,
        ),
        _v(
            "GATEWAY_ROUTES_STALE_S",
            "int",
            15,
            "a deployment is reported SERVING once every running gateway routes its active version; a gateway "
            "that has not reported what it routes for this long is no longer waited for",
            2,
        ),
        _v(
            "GATEWAY_WAKE_POLL_MS",
            "int",
            200,
            "how often the gateway command's wake thread reads the wake-ups its Lua action signals (it also reads them at once on the Lua action's signal)",
            20,
        ),
        _v(
            "GATEWAY_CHECK_INTERVAL_MS", "int", 500, "HAProxy's health-check interval per backend server", 100
        ),
        _v(
            "GATEWAY_BUFFER_BYTES",
            "int",
            16384,
            "HAProxy's buffer (`tune.bufsize`): HTTP requests up to it are kept whole for retries; a gRPC "
            "call's model name and version must be in its first bytes (the head read from this buffer)",
            16384,
        ),
        _v(
            "GATEWAY_SERVER_MAXCONN",
            "int",
            64,
            "requests the gateway sends one replica of a model at once (HAProxy's server `maxconn`); more wait "
            "in the gateway's queue, interactive callers' before batch ones (0: no limit and no priority queue)",
            0,
        ),
        _v(
            "GATEWAY_GRPC_MAX_MESSAGE_BYTES",
            "int",
            64 * 2**20,
            "the largest gRPC request message the gateway forwards (walked field by field as it streams "
            "through); larger ones get RESOURCE_EXHAUSTED naming the limit",
            65536,
        ),
        _v(
            "GATEWAY_SLOT_CHUNK",
            "int",
            64,
            "pre-declared backend slots added, with a graceful reload, when every slot is taken",
            1,
        ),
        _v(
            "GATEWAY_DEFAULT_REQUESTS_PER_SECOND",
            "int",
            1000,
            "`Team.quota_requests_per_second` of a new team",
            1,
        ),
    ),
    "Progressive rollouts": (
        _v("ROLLOUT_TICK_MS", "int", 1000, "how often beat looks for due rollout checks", 200),
        _v(
            "ROLLOUT_UNLOAD_DELAY_S",
            "int",
            3,
            "how long after a rollback the canary is unloaded (the gateway syncs first)",
            0,
        ),
        _v("ROLLOUT_MIN_INTERVAL_S", "int", 2, "the shortest step interval a user may choose", 1),
        _v("ROLLOUT_MAX_INTERVAL_S", "int", 3600, "the longest step interval a user may choose", 1),
    ),
    "Alerts and email": (
        _v(
            "ALERT_WEBHOOK_ALLOW_PRIVATE",
            "bool",
            DERIVED,
            "let alert webhooks reach loopback/private/link-local addresses (off in production: see Alerts)",
            default_text="on when `DEBUG` is on",
        ),
        _v("ALERT_WEBHOOK_TIMEOUT", "int", 10, "one webhook call's limit, in seconds", 1),
        _v("ALERT_DELIVERY_MAX_RETRIES", "int", 6, "retries of a failed notification", 0),
        _v(
            "ALERT_DELIVERY_RETRY_BACKOFF",
            "int",
            15,
            "seconds before the first retry; doubling (at most 10 min apart), with jitter",
            1,
        ),
        _v("ALERT_MAX_RULES_PER_TEAM", "int", 200, "alert rules one team may create", 1),
        _v("ALERT_MAX_CHANNELS_PER_TEAM", "int", 20, "notification channels one team may create", 1),
        _v("ALERT_MAX_SILENCE_DAYS", "int", 30, "the longest silence, in days", 1),
        _v(
            "EMAIL_BACKEND",
            "str",
            None,
            "Django's mail backend, for email notifications",
            default_text="the console backend when `DEBUG` is on, else SMTP",
        ),
        _v("EMAIL_HOST", "str", "localhost", "SMTP server"),
        _v("EMAIL_PORT", "int", 25, "SMTP port", 1),
        _v("EMAIL_HOST_USER", "str", "", "SMTP user"),
        _v("EMAIL_HOST_PASSWORD", "str", "", "SMTP password"),
        _v("EMAIL_USE_TLS", "bool", False, "STARTTLS to the SMTP server"),
        _v("EMAIL_TIMEOUT", "int", 10, "seconds an SMTP exchange may take", 1),
        _v("DEFAULT_FROM_EMAIL", "str", "alerts@triton-ge.invalid", "the sender of notifications"),
    ),
    "Demo account (`manage.py bootstrap_demo`, run by `make run`)": (
        _v("DEMO_USERNAME", "str", "admin", "the demo user's name"),
        _v(
            "DEMO_PASSWORD",
            "str",
            None,
            "the demo user's password",
            default_text="generated once into `var/demo_password`",
        ),
        _v("DEMO_TEAM", "str", "Demo", "the demo team's name"),
    ),
    "Single sign-on (OpenID Connect)": (
        _v(
            "OIDC_ISSUER",
            "str",
            "",
            "the identity provider's issuer URL; single sign-on is off while it is unset",
        ),
        _v(
            "OIDC_PROVIDER_NAME",
            "str",
            "single sign-on",
            "the provider's name on the button: Sign in with <name>",
        ),
        _v(
            "OIDC_CLIENT_ID",
            "str",
            "",
            "the platform's client id at the provider (required with OIDC_ISSUER)",
        ),
        _v("OIDC_CLIENT_SECRET", "str", "", "the platform's client secret (required with OIDC_ISSUER)"),
        _v("OIDC_SCOPES", "str", "openid email profile", "the scopes a sign-in asks for"),
        _v("OIDC_SIGN_ALGO", "str", "RS256", "the ID token's signing algorithm"),
        _v("OIDC_GROUPS_CLAIM", "str", "groups", "the claim whose values map to team memberships"),
        _v(
            "OIDC_GROUP_PREFIX",
            "str",
            "tgp:",
            "a claim value `<prefix><team>:<role>` grants that role in that team",
        ),
        _v("OIDC_USERNAME_CLAIM", "str", "preferred_username", "the claim a new user's username comes from"),
        _v(
            "OIDC_CLOCK_SKEW_S",
            "int",
            60,
            "the clock skew allowed on the ID token's exp and iat",
            0,
            maximum=300,
        ),
        _v("OIDC_TIMEOUT_S", "int", 10, "the longest call to the provider, in seconds", 1),
        _v("LOCAL_SIGN_IN", "bool", True, "sign-in with local passwords; off needs OIDC_ISSUER"),
    ),
}

VARIABLES: dict[str, Variable] = {var.name: var for section in SECTIONS.values() for var in section}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The configuration reference: one table per section, generated from ``SECTIONS``."""
    lines = [
        "# Configuration reference",
        "",
        "Every environment variable the platform's settings read, generated from the one list the settings "
        "read them through (`serving_platform/config_reference.py`). A value that cannot be read stops the "
        'process at start (`DEBUG=perhaps` is an error, not "false"); an integer below its minimum too.',
        "",
    ]
    for title, variables in SECTIONS.items():
        lines += [
            f"## {title}",
            "",
            "| variable | type | default | minimum | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for var in variables:
            minimum = "" if var.minimum is None else str(var.minimum)
            if var.maximum is not None:
                minimum += f" (at most {var.maximum})"
            lines.append(
                f"| `{var.name}` | {var.type} | {_cell(var.shown_default())} | {minimum} | {_cell(var.meaning)} |"
            )
        lines.append("")
    return "\n".join(lines)
