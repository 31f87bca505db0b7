"""The operator console: dead letters, backlog and owners over HTTP, and a page on top.

Served by ``outbox serve`` under ``/console`` when ``OUTBOX_CONSOLE=true`` (off by default), on
the runs API's app, behind its bearer tokens (:mod:`runs.auth`). It reads what ``outbox dlq``
and ``outbox status`` read, through the same functions (:mod:`consumer.dead_letters`,
:mod:`relay.backlog`, the status report the CLI passes in), and it replays and purges through
them too; what it adds is the record of who did what (:mod:`console.action_log`) and the answer
to a request repeated after it was done.

Layering: the console sits above ``relay`` and ``consumer`` (it shows both), uses ``runs`` only
for the API's callers and error shape, and only ``cli`` imports it (to mount it).
"""
