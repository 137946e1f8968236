# Two images from one file:
#   platform   (default target): web, worker, beat, gateway - Django, Celery, HAProxy, the front end's npm packages.
#   host-agent (--target host-agent, on a CANN base image): `python -m hostagent` with backend_ge and their few
#              dependencies only - no Django, no Node.js, no HAProxy, no platform secret.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG AGENT_BASE_IMAGE=python:3.11-slim-bookworm

FROM ${AGENT_BASE_IMAGE} AS host-agent
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 FLEET_ROOT=/fleet
WORKDIR /src
COPY agent/pyproject.toml ./
COPY backend_ge backend_ge
COPY hostagent hostagent
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
# Runs as root: it gives every Triton instance an unprivileged user of its own (see the README's sandbox).
ENTRYPOINT ["python", "-m", "hostagent"]

FROM ${BASE_IMAGE} AS platform
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 VAR_DIR=/app/var
RUN apt-get update && apt-get install -y --no-install-recommends nodejs npm haproxy && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY serving_platform serving_platform
COPY apps apps
COPY backend_ge backend_ge
COPY hostagent hostagent
COPY frontend frontend
COPY manage.py Procfile ./
RUN pip install --no-cache-dir . \
    && cd frontend && npm ci --no-audit --no-fund --loglevel=error
RUN DEBUG=1 SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput
RUN useradd --create-home --uid 1000 platform && mkdir -p /app/var/gateway && chown -R platform /app/var
USER platform
EXPOSE 8000
# Threads, not only processes: an agent's long poll holds one thread for up to 30 s (WEB_THREADS, read by the
# settings too: a process holds at most WEB_THREADS - 16 polls, the rest of its threads serve the UI and API).
ENV WEB_WORKERS=3 WEB_THREADS=64
CMD ["sh", "-c", "exec gunicorn serving_platform.wsgi --config python:serving_platform.gunicorn_hooks --bind 0.0.0.0:8000 --workers \"$WEB_WORKERS\" --threads \"$WEB_THREADS\" --worker-class gthread --access-logfile -"]
