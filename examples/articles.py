"""Durable runs with your own stages: fetch an article, summarize it (asking the user once),
publish the summary. Shown in docs/runs.md.

    outbox db upgrade --runs                          # the core tables and the runs table
    outbox serve &                                    # POST /runs, GET /runs/{id}, answers
    outbox relay &
    outbox consume --app examples.articles:runs       # the run worker with these stages

A run survives a crash of its worker at any point: each stage's output is a checkpoint, so only
the interrupted stage runs again (stages must be safe to repeat). A stage that asks returns its
output with its questions; once every question is answered the run goes on with the *next*
stage, which reads the answers.
"""

from __future__ import annotations

from outbox_relay.runs import AgentError, Pipeline, Question, Runs, StageContext, StageResult

PIPELINE = Pipeline(["fetch", "summarize", "publish"], asking=["summarize"])


class ArticleAgent:
    """The stage code. Called outside any transaction, one stage at a time, with the run's
    request, the finished stages' outputs (``checkpoint``) and the answers so far."""

    def run_stage(self, stage: str, context: StageContext, /) -> StageResult:
        if stage == "fetch":
            url = context.request.get("url")
            if not isinstance(url, str) or not url.startswith("https://"):
                raise AgentError("the request needs an https url")  # the run fails
            return StageResult({"url": url, "text": f"the article at {url}"})
        if stage == "summarize":
            summary = f"a summary of {context.checkpoint['fetch']['text']}"
            if "title" in context.answers:  # already answered (a retried stage): ask no more
                return StageResult({"summary": summary})
            # The run waits in needs_input; once answered it goes on with the next stage.
            question = Question(interaction_id="title", prompt="Which title shall we publish?")
            return StageResult({"summary": summary}, [question])
        return StageResult({"title": context.answers["title"],
                            "summary": context.checkpoint["summarize"]["summary"]})


runs = Runs(PIPELINE, ArticleAgent)
"""``outbox consume --app examples.articles:runs``: the worker for these stages."""
