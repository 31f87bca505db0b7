# The outbox-relay daemons: `outbox relay`, `outbox consume`, `outbox serve`, `outbox db upgrade`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip install --no-cache-dir '.[postgres]' && useradd --system --uid 10001 outbox
USER outbox
ENTRYPOINT ["outbox"]
CMD ["--help"]
