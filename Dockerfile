# The outbox-relay daemons: `outbox relay`, `outbox consume`, `outbox serve`, `outbox db upgrade`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY shared ./shared
COPY producer ./producer
COPY relay ./relay
COPY consumer ./consumer
COPY runs ./runs
COPY cli ./cli
# outbox_relay/ holds the facade and symlinks to the folders above (COPY keeps them).
COPY outbox_relay ./outbox_relay
RUN pip install --no-cache-dir '.[postgres]' && useradd --system --uid 10001 outbox
USER outbox
ENTRYPOINT ["outbox"]
CMD ["--help"]
