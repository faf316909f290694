"""The local sweep cluster listens on loopback only (issue 17, item 16): Dask's scheduler took
``dashboard_address=":0"`` as every interface and served its HTTP pages on 0.0.0.0."""

from __future__ import annotations

import ipaddress

import psutil

from cachelib.sweep import parse_grid
from cachelib.sweep.cluster import start_local_cluster

GRID = """\
name = "sockets"
models = ["tiny-llama"]
devices = ["cpu"]
strategies = ["rotating:max_size=8"]
prompts = ["hello"]
max_tokens = 2
"""


def _listening(process: psutil.Process) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket ``process`` and its children listen on."""
    out = []
    for p in [process, *process.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a helper process that ended meanwhile
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_a_local_cluster_binds_no_socket_outside_loopback(tmp_path):
    points = parse_grid(GRID, tmp_path / "grid.toml").points()
    me = psutil.Process()
    before = set(_listening(me))
    cluster = start_local_cluster(points, workers=1)
    try:
        assert len(cluster.workers) == 1
        opened = [s for s in _listening(me) if s not in before]
        # scheduler comm + its HTTP server, the nanny, the worker's comm + its HTTP server
        assert len(opened) >= 4, opened
        outside = [s for s in opened if not ipaddress.ip_address(s[1]).is_loopback]
        assert outside == [], f"listening beyond loopback: {outside}"
        workers = {pid for pid, _, _ in opened if pid != me.pid}
        assert workers, "the worker process should listen too (its comm and HTTP server)"
    finally:
        cluster.close()
