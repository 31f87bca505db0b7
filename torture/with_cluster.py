"""``python -m torture.with_cluster COMMAND …``: run COMMAND against a Redis Cluster of its own.

Starts a local 3-master cluster with a replica each (:class:`torture.redis_sets.LocalCluster`,
about 1.5 s), runs COMMAND with ``OUTBOX_TEST_REDIS_URL`` set to its ``redis+cluster://`` URL,
stops every node by pid and exits with COMMAND's status. ``make test`` runs the integration
suite this way a second time, so that every test of the relay, the consumers, repair, trim,
the dead letters and the CLI also passes with each partition stream on its own slot and the
streams spread over three masters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from torture.redis_sets import LocalCluster


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="outbox-cluster-") as folder, \
            LocalCluster(Path(folder)) as cluster:
        print(f"Redis Cluster up in {cluster.start_seconds:.1f}s: {cluster.url}", flush=True)
        env = {**os.environ, "OUTBOX_TEST_REDIS_URL": cluster.url}
        return subprocess.run(argv, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
