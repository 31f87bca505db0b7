# The outbox-relay daemons: `outbox relay`, `outbox consume`, `outbox serve`, `outbox db upgrade`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# [http]: `outbox serve` (the runs HTTP API) runs from this image too.
RUN pip install --no-cache-dir '.[postgres,http]' && useradd --system --uid 10001 outbox
USER 10001

# In a container every daemon serves /metrics, /healthz and /readyz on 9100, on every
# interface (the default, 127.0.0.1, is for a host), so Prometheus and probes reach it;
# `outbox serve` listens on 8080 likewise, so it needs its tokens (OUTBOX_API_TOKENS or
# OUTBOX_API_TOKENS_FILE; docs/security.md). Override any of them with -e / env:.
ENV OUTBOX_METRICS_PORT=9100 OUTBOX_METRICS_HOST=0.0.0.0 OUTBOX_HOST=0.0.0.0 OUTBOX_PORT=8080
EXPOSE 9100 8080

# Liveness of whichever daemon runs: its /healthz (200 while its loop turns). One-shot commands
# (`db upgrade`) exit before the first check; OUTBOX_METRICS_PORT=0 turns the check off.
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; p = os.environ.get('OUTBOX_METRICS_PORT', '9100'); p == '0' or u.urlopen(f'http://127.0.0.1:{p}/healthz', timeout=5)"]

ENTRYPOINT ["outbox"]
CMD ["--help"]
