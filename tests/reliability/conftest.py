"""Fixtures of the reliability tests: a fleet of real worker processes and TCP proxies."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliability_helpers import Fleet, TcpProxy


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A Fleet whose workers are all stopped at the end (their logs shown if the test failed)."""
    made = Fleet(tmp_path)
    try:
        yield made
    finally:
        made.stop_all()
        for worker in made.workers[:6]:
            print(f"----- {worker.name}\n{worker.logs()[-4000:]}")


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """tcp_proxy(host, port) -> a TcpProxy to it on a free loopback port; closed at the end."""
    proxies: list[TcpProxy] = []

    def make(host: str, port: int) -> TcpProxy:
        proxies.append(TcpProxy(host, port))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()
