# Two images from one file (`make images` builds both with podman; `docker build` works the same):
#   platform   (default target): web, worker, beat, gateway - Django, Celery, HAProxy and the collected static
#              files (the front end's npm packages are fetched in a build stage only: no Node.js in the image).
#   host-agent (--target host-agent, on a CANN base image on NPU hosts): `python -m hostagent` with backend_ge and
#              their few dependencies only - no Django, no Node.js, no HAProxy, no platform secret.
# Both bases need python3 (3.11) with its venv module; where no registry answers, `make images` bootstraps one
# from Debian's packages (deploy/images.py). Python dependencies are installed before the sources are copied, so
# a rebuild from a newer commit reuses those layers (the `requirements` stage). Where the package registries are reached through a proxy
# with its own certificate authority, `make images` passes the build machine's CA bundle as the build secret
# `ca` (never a layer of the image): pip and npm trust it while they download.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG AGENT_BASE_IMAGE=python:3.11-slim-bookworm

# The pinned dependencies of both distributions, as files: a change elsewhere in pyproject.toml (a dev tool)
# leaves the layers that install them cached.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml /src/pyproject.toml
COPY agent/pyproject.toml /src/agent/pyproject.toml
RUN cd /src && for f in pyproject.toml agent/pyproject.toml; do \
      python3 -c "import sys, tomllib; print('\n'.join(tomllib.load(open(sys.argv[1], 'rb'))['project']['dependencies']))" "$f" \
        > "$(dirname "$f")/requirements.txt"; done

FROM ${AGENT_BASE_IMAGE} AS host-agent
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH FLEET_ROOT=/fleet
COPY --from=requirements /src/agent/requirements.txt /src/requirements.txt
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && python3 -m venv /opt/venv \
    && pip install --no-cache-dir --disable-pip-version-check -r /src/requirements.txt
COPY agent/pyproject.toml /src/pyproject.toml
COPY backend_ge /src/backend_ge
COPY hostagent /src/hostagent
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install --no-cache-dir --disable-pip-version-check --no-deps /src && rm -rf /src
WORKDIR /
# The agent runs as root with six capabilities (compose: cap_drop ALL + cap_add; Kubernetes: the DaemonSet's
# securityContext): it gives every Triton instance and its Python stubs an unprivileged user of their own
# (backend_ge/sandbox.py), which needs useradd and setresuid. Without --platform (or PLATFORM_URL) or a
# credential it exits at once, saying which is missing.
ENTRYPOINT ["python", "-m", "hostagent"]

FROM ${BASE_IMAGE} AS platform-build
ENV PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends npm && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && python3 -m venv /opt/venv \
    && pip install --no-cache-dir --disable-pip-version-check -r /tmp/requirements.txt
COPY frontend/package.json frontend/package-lock.json frontend/
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export NPM_CONFIG_CAFILE=/run/secrets/ca; fi \
    && cd frontend && npm ci --no-audit --no-fund --loglevel=error && rm -rf /root/.npm
COPY serving_platform serving_platform
COPY apps apps
COPY backend_ge backend_ge
COPY hostagent hostagent
COPY frontend frontend
COPY manage.py ./
RUN DEBUG=1 STATIC_MANIFEST=1 SECRET_KEY=collectstatic-only VAR_DIR=/app/var python manage.py collectstatic --noinput -v 0

FROM ${BASE_IMAGE} AS platform
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PYTHONPATH=/app VAR_DIR=/app/var
RUN apt-get update && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --create-home --uid 1000 platform
COPY --from=platform-build /opt/venv /opt/venv
WORKDIR /app
COPY serving_platform serving_platform
COPY apps apps
COPY backend_ge backend_ge
COPY hostagent hostagent
COPY tgp tgp
COPY frontend/*.py frontend/
COPY frontend/templates frontend/templates
COPY frontend/templatetags frontend/templatetags
COPY frontend/static frontend/static
COPY manage.py Procfile ./
COPY --from=platform-build /app/var/staticfiles /app/var/staticfiles
RUN mkdir -p /app/var/gateway /app/var/celery /artifacts && chown -R platform /app/var /artifacts
USER platform
EXPOSE 8000
# Threads, not only processes: an agent's long poll holds one thread for up to 30 s (WEB_THREADS, read by the
# settings too: a process holds at most WEB_THREADS - 16 polls, the rest of its threads serve the UI and API).
ENV WEB_WORKERS=3 WEB_THREADS=64
CMD ["sh", "-c", "exec gunicorn serving_platform.wsgi --config python:serving_platform.gunicorn_hooks --bind 0.0.0.0:8000 --workers \"$WEB_WORKERS\" --threads \"$WEB_THREADS\" --worker-class gthread --access-logfile -"]
