"""One modern ClickHouse node (26.9) of the local cluster, served by PyPI's chdb-core.

    python modern_node.py CONFIG_XML DATA_DIR

chdb-core is ClickHouse built as clickhouse-local inside a Python extension. Its module-level
query runs a full LocalServer, which reads ./config.xml (listen_host, http_port, tcp_port) from
the working directory and can start the HTTP and native listeners; they live as long as that one
call runs. So the call starts them and then runs a statement that never ends, and the node is
stopped by signalling this process (scripts/cluster.sh stop/kill). The config's path is on this
process's command line because cluster.sh finds a node's server by it.

Written for scripts/cluster.sh; run it from there.
"""

import os
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: modern_node.py CONFIG_XML DATA_DIR", file=sys.stderr)
        return 2
    config, data = (os.path.abspath(a) for a in sys.argv[1:])
    if os.path.basename(config) != "config.xml":
        # LocalServer reads only ./config.xml.
        print(f"modern_node.py: the config must be named config.xml, not {config}", file=sys.stderr)
        return 2
    os.makedirs(data, exist_ok=True)
    os.chdir(os.path.dirname(config))
    from chdb import _chdb  # noqa: PLC0415 (after chdir: LocalServer reads ./config.xml at import time too)

    # A statement that outlives any test run: about 31 years of one-second sleeps.
    forever = (
        "SELECT sleepEachRow(1) FROM numbers(1000000000) "
        "SETTINGS max_block_size = 1, max_execution_time = 0 FORMAT Null"
    )
    _chdb.query(f"SYSTEM START LISTEN HTTP; SYSTEM START LISTEN TCP; {forever}", "TSV", path=data)
    # The call returns only if the listeners could not start (a failed start is not an error of
    # the call): say so, so that the log tells cluster.sh's reader why the node is gone.
    print("modern_node.py: the server's query ended; the node is no longer serving", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
