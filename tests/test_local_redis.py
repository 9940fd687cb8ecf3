"""The Redis `pagedserve up` starts when none answers listens where its URL says: a real redis-server started with
``redis_settings`` answers at the URL's host (it bound 127.0.0.1 whatever the host, so ``redis://[::1]:PORT`` never
answered and `up` gave up after 30 s)."""

from __future__ import annotations

import subprocess
import time
from urllib.parse import urlparse

import pytest

from pagedserve.local_redis import redis_answers, redis_settings
from tests.e2e.ports import free_port, has_ipv6_loopback


@pytest.mark.parametrize("host", ["[::1]", "localhost", "127.0.0.1"])
def test_a_local_redis_answers_at_the_host_of_its_url(tmp_path, host):
    if host == "[::1]" and not has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    url = f"redis://:pw@{host}:{free_port()}/0"
    server = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    server.stdin.write(redis_settings(urlparse(url).port, tmp_path, urlparse(url)))
    server.stdin.close()
    try:
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            assert server.poll() is None and time.monotonic() < deadline, f"no Redis answers at {url}"
            time.sleep(0.1)
    finally:
        server.terminate()
        server.wait(10)
