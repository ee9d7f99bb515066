"""What `resilience.watch.Watch` reads, faked for unit tests: a worker group whose ranks never
exit, and a store of heartbeats in a dict (counting reads)."""

from __future__ import annotations


class FakeGroup:
    """A worker group as the watch sees it: heartbeats in a dict, nothing exits."""

    def __init__(self, n: int) -> None:
        self.subprocess_handlers: dict = {}
        self.n = n

    def pids(self) -> dict[int, int]:
        return dict.fromkeys(range(self.n), 0)


class FakeStore:
    def __init__(self) -> None:
        self.kv: dict[str, str] = {}
        self.gets = 0

    def check(self, keys) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        self.gets += 1
        return self.kv[key].encode()
