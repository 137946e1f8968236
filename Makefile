# The two commands of the quick start: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export DEBUG ?= 1

.PHONY: run test install migrate demo lint deploy-check clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

frontend/node_modules/.installed: frontend/package.json frontend/package-lock.json
	cd frontend && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

install: $(VENV)/.installed frontend/node_modules/.installed

migrate: install
	$(PY) manage.py migrate --noinput

demo: migrate
	$(PY) manage.py bootstrap_demo

## Start web (http://127.0.0.1:8000), Celery worker and beat together. No PostgreSQL/Redis needed.
run: demo
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/honcho start -f Procfile

## Run the whole test suite (set DATABASE_URL / CELERY_BROKER_URL to test on PostgreSQL + Redis).
test: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

## Production-settings check: what `manage.py check --deploy` says with DEBUG off.
deploy-check: install
	DEBUG=0 SECRET_KEY=$$($(PY) -c 'import secrets;print(secrets.token_urlsafe(64))') ALLOWED_HOSTS=platform.example.com \
		$(PY) manage.py check --deploy --fail-level WARNING

clean:
	rm -rf var/celery var/staticfiles
