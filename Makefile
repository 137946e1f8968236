# The two commands of the quick start: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export DEBUG ?= 1

.PHONY: run test test-fast install migrate demo lint deploy-check npu-check clean haproxy chromium docs images podman stack-check

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

frontend/node_modules/.installed: frontend/package.json frontend/package-lock.json
	cd frontend && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

## The single sign-on tests' OpenID Connect provider (npm's oidc-provider, run with node); test-only.
tests/oidc/provider/node_modules/.installed: tests/oidc/provider/package.json tests/oidc/provider/package-lock.json
	cd tests/oidc/provider && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

install: $(VENV)/.installed frontend/node_modules/.installed tests/oidc/provider/node_modules/.installed haproxy

## The inference gateway is HAProxy (Debian package `haproxy`); installed here when we are root on Debian.
haproxy:
	@command -v haproxy >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; } || \
		{ echo "haproxy is missing: install it with 'sudo apt-get install haproxy' (Debian/Ubuntu), then run make again"; exit 1; }

## The browser tests drive Debian's chromium: installed here when we are root on Debian; without it they are
## skipped, each with the reason.
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is missing: the browser tests will be skipped (install it with 'sudo apt-get install chromium')"

migrate: install
	$(PY) manage.py migrate --noinput

## The local host agent of `make run` runs `python -m hostagent` over loopback like a remote one. Its settings,
## in one place: its root (its credential is the agent's default ROOT/host-credential, written by `make demo`)
## and what its Triton servers must not read - the platform's own state on this machine.
LOCAL_VAR := $(or $(VAR_DIR),var)
LOCAL_FLEET_ROOT := $(LOCAL_VAR)/fleet
LOCAL_DB := $(LOCAL_VAR)/db.sqlite3
LOCAL_AGENT_ENV := FLEET_ROOT=$(LOCAL_FLEET_ROOT) AGENT_PRIVATE_PATHS=$(or $(ARTIFACT_ROOT),$(LOCAL_VAR)/artifacts):$(or $(GATEWAY_DIR),$(LOCAL_VAR)/gateway):$(LOCAL_VAR)/secret_key:$(LOCAL_VAR)/demo_password:$(LOCAL_VAR)/celery:$(LOCAL_DB):$(LOCAL_DB)-wal:$(LOCAL_DB)-shm

demo: migrate
	$(PY) manage.py bootstrap_demo
	$(LOCAL_AGENT_ENV) $(PY) manage.py fleet_local_host --name local --address 127.0.0.1 --pool local \
		--instance cpu-0:$${TRITON_HTTP_PORT:-8100}:$${TRITON_GRPC_PORT:-8101}:$${TRITON_METRICS_PORT:-8102}

## Start web (http://127.0.0.1:8000), Celery worker and beat, the local host agent and the inference gateway
## (http://127.0.0.1:8080, GATEWAY_BIND) together. No PostgreSQL/Redis needed.
run: demo
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(LOCAL_AGENT_ENV) $(VENV)/bin/honcho start -f Procfile

## Test processes side by side (pytest-xdist): most live tests wait on real servers, so two workers fill two
## cores. Each worker has its own test database; a module's tests stay together on one worker, so the servers
## a module shares start once. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

## Run the whole test suite (set DATABASE_URL / CELERY_BROKER_URL to test on PostgreSQL + Redis).
test: install chromium
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

## The developer's loop: no real servers, no browser - what a change to a view or a service needs.
## tests.no_servers fails a test there that starts a server without its mark; no test collected fails too.
FAST_MARKERS := not triton and not servers and not browser and not fuzz
test-fast: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_PARALLEL) -p tests.no_servers -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

## The documentation site (MkDocs + Material) on http://127.0.0.1:8001, rebuilt on every change; the generated
## reference pages (settings, agent options) are written first. `make test` runs `mkdocs build --strict`.
DOCS_BIND ?= 127.0.0.1:8001
docs: $(VENV)/.installed
	$(PY) docs/generate_reference.py
	$(VENV)/bin/mkdocs serve --dev-addr $(DOCS_BIND)

## Production-settings check: what `manage.py check --deploy` says with DEBUG off.
deploy-check: install
	DEBUG=0 SECRET_KEY=$$($(PY) -c 'import secrets;print(secrets.token_urlsafe(64))') ALLOWED_HOSTS=platform.example.com \
		$(PY) manage.py check --deploy --fail-level WARNING

## On an Ascend host (CANN's set_env.sh sourced): compile, run, serve and benchmark on the NPU; a table + JSON.
## NPU_CHECK_ARGS="--fake" runs it against the project's fakes, e.g. on a machine without an NPU.
npu-check: $(VENV)/.installed
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m backend_ge npu-check --json var/npu-check.json $(NPU_CHECK_ARGS)

clean:
	rm -rf var/celery var/staticfiles

## The Kubernetes manifests (deploy/kubernetes/) played with podman kube play on this machine: the platform with
## PostgreSQL and Redis, the host agent's pod, one inference through the gateway. Needs the two images (make images).
.PHONY: k8s-check
k8s-check: $(VENV)/.installed
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) deploy/kubernetes/play_check.py $(K8S_CHECK_ARGS)

## podman, runc and mmdebstrap (the images, the stack check; podman-compose comes with the dev extras): installed here when we are root on Debian.
podman:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v mmdebstrap >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >/dev/null; } || \
		{ echo "podman is missing: install podman, runc and mmdebstrap (Debian/Ubuntu: apt-get install podman runc mmdebstrap)"; exit 1; }

## The platform image and the host-agent image (Dockerfile) with podman; the base is bootstrapped from Debian's
## packages where no registry answers. Prints both sizes.
images: podman
	$(PYTHON) deploy/images.py $(IMAGES_ARGS)

## docker-compose.yml started for real with podman-compose (deploy/compose/stack_check.py): every service's
## healthcheck, a team, token and host through the API, the seed's MLP and ResNet-50 uploaded and deployed, seed
## examples 1 and 3 through the gateway, down/up, killed containers, a 60 s control-plane outage under load and an
## upgrade in place. STACK_CHECK_ARGS="--keep" leaves it running.
stack-check: images $(VENV)/.installed
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) deploy/compose/stack_check.py $(STACK_CHECK_ARGS)
