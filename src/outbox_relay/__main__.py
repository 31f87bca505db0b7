"""``python -m outbox_relay``: the ``outbox`` command."""

import sys

from outbox_relay.cli.main import main

sys.exit(main())
