"""Where evicted or written-through KV blocks live outside the device pool: host memory, a disk
folder, a Redis (or Valkey) server. Each stores opaque record bytes (``record.py``) under a block key
and knows nothing of tensors; checks happen when a record is decoded. Plain Python, no torch.

Every backend is safe to call from the engine thread (lookups) and the store's writer thread
(writes) at once.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path


class HostTier:
    """Records in this process's memory, LRU within ``capacity_bytes``; filled with blocks the device
    pool evicts (on CUDA this is the host RAM behind the GPU; on a CPU it is the same RAM as the pool,
    so it is off unless asked for)."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._records: OrderedDict[bytes, bytes] = OrderedDict()
        self.num_bytes = 0
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            found = []
            for key in keys:
                record = self._records.get(key)
                if record is not None:
                    self._records.move_to_end(key)
                found.append(record)
            return found

    def has_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._records for key in keys]

    def put(self, key: bytes, record: bytes) -> bool:
        """Keep ``record``; False when it was not stored (larger than the whole tier)."""
        if len(record) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return True
            self._records[key] = record
            self.num_bytes += len(record)
            while self.num_bytes > self.capacity_bytes:
                _, dropped = self._records.popitem(last=False)
                self.num_bytes -= len(dropped)
            return True

    def delete(self, key: bytes) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self.num_bytes -= len(record)

    def clear(self) -> int:
        with self._lock:
            count = len(self._records)
            self._records.clear()
            self.num_bytes = 0
            return count


class DiskTier:
    """One file per block under ``directory/<fingerprint>/``, LRU within ``capacity_bytes``.

    Writes go to a temporary file in the same folder, then ``os.replace``: a crash leaves either the
    whole record or none, and a write that fails (a full disk) removes its temporary file and raises.
    Files left by earlier runs are found at start-up (oldest first, by mtime), so a restarted server
    hits what the last one computed. Keys protected by ``protect`` (pinned prefixes) are never
    dropped to make room.
    """

    name = "disk"
    SUFFIX = ".kvb"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, fingerprint: str) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_disk_size must be positive, got {capacity_bytes}")
        self.root = Path(directory) / fingerprint[:32]
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._protected: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        self.num_bytes = 0
        entries = []
        for path in self.root.glob(f"*{self.SUFFIX}"):
            try:
                stat = path.stat()
                key = bytes.fromhex(path.name[: -len(self.SUFFIX)])
            except (OSError, ValueError):
                continue
            entries.append((stat.st_mtime_ns, key, stat.st_size))
        for _, key, size in sorted(entries):
            self._sizes[key] = size
            self.num_bytes += size
        self._make_room()  # a restart with a smaller capacity_bytes: the oldest files go now
        for leftover in self.root.glob("*.tmp-*"):  # a write interrupted by a crash
            leftover.unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}{self.SUFFIX}"

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        found: list[bytes | None] = []
        for key in keys:
            with self._lock:
                known = key in self._sizes
                if known:
                    self._sizes.move_to_end(key)
            record = None
            if known:
                try:
                    record = self._path(key).read_bytes()
                except OSError:
                    self.delete(key)
            found.append(record)
        return found

    def has_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys have a file (known from the folder, not read)."""
        with self._lock:
            return [key in self._sizes for key in keys]

    def put(self, key: bytes, record: bytes) -> bool:
        """Write ``record`` (atomically); False when it was not stored (larger than the whole tier); an
        OSError (a full or read-only disk) leaves no file behind and is raised for the store to count."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return True
        if len(record) > self.capacity_bytes:
            return False
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(temporary, "wb") as handle:
                handle.write(record)
            os.replace(temporary, path)
        except BaseException:  # a full disk (ENOSPC) mid-write, or anything else: no partial file stays
            temporary.unlink(missing_ok=True)
            raise
        with self._lock:
            self._sizes[key] = len(record)
            self.num_bytes += len(record)
            self._make_room()
            return key in self._sizes

    def _make_room(self) -> None:
        for key in list(self._sizes):
            if self.num_bytes <= self.capacity_bytes:
                return
            if self._protected[key] > 0:
                continue
            self.num_bytes -= self._sizes.pop(key)
            self._path(key).unlink(missing_ok=True)

    def delete(self, key: bytes) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.num_bytes -= size
        self._path(key).unlink(missing_ok=True)

    def protect(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._protected.update(keys)

    def unprotect(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._protected.subtract(keys)
            for key in [key for key, count in self._protected.items() if count <= 0]:
                del self._protected[key]
            self._make_room()

    def clear(self) -> int:
        with self._lock:
            keys = [key for key in self._sizes if self._protected[key] <= 0]
        for key in keys:
            self.delete(key)
        return len(keys)


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")  # a Redis Cluster, reached through any of its nodes


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """(host, port) of each node a ``redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]`` URL lists
    (port 6379 where none is given); a ValueError names an address that is not HOST:PORT."""
    from urllib.parse import urlsplit

    hosts = urlsplit(url).netloc.rpartition("@")[2]
    nodes = []
    for address in hosts.split(","):
        host, separator, port = address.rpartition(":")
        if not separator:
            host, port = address, "6379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_remote_url: cluster node {address!r} is not HOST:PORT")
        nodes.append((host, int(port)))
    return nodes


class RedisTier:
    """Records in a Redis or Valkey server (redis-py), shared by every kvreuse server that uses it.

    A server that is down, slow or refusing never fails a request: each call's connect and each wait for
    the next bytes are bounded by ``timeout_s`` (a record of megabytes, a hybrid's state, may take longer to
    arrive while its bytes keep coming), and after a failure the tier answers misses without
    touching the network for ``retry_s`` seconds. So a lookup costs at most ``timeout_s`` once per
    ``retry_s`` while Redis is away, and nothing otherwise.

    A ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (or ``rediss+cluster://``) URL names nodes of a Redis
    Cluster: redis-py's RedisCluster learns the slot map from the first that answers and sends each key to
    its slot's master. A record is one key (its
    header, tokens and checksum travel inside it), so nothing needs two keys in one slot, and records
    spread over every master; a lookup of several blocks is split by slot (``mget_nonatomic``). While a
    master fails over, its slots' lookups fail and answer misses like a server that is down (redis-py
    re-reads the slot map after such errors); the promoted replica serves what it had replicated, and
    every record is verified when read.
    """

    name = "remote"

    def __init__(self, url: str, fingerprint: str, timeout_s: float = 0.25, retry_s: float = 5.0) -> None:
        import redis  # optional dependency: only servers with --kv-remote-url need it

        self.url = url
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self._cluster_nodes = cluster_nodes(url) if self.cluster else []
        self._redis = redis
        self._timeout_s = timeout_s
        # A cluster client connects to learn the slots when made: made on first use, so a cluster that is
        # down at start-up costs misses like a server that is down, not a failed start.
        self._client = None if self.cluster else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = f"kvreuse:v{1}:{fingerprint}:".encode()
        self.retry_s = retry_s
        self._down_until = 0.0
        self.num_errors = 0
        # RedisClusterException (no node reachable, slots uncovered) is not a RedisError.
        self._errors = (redis.RedisError, OSError, redis.exceptions.RedisClusterException)

    @property
    def client(self):
        if self._client is None:
            self._client = self._connect_cluster()
        return self._client

    def _connect_cluster(self):
        """A RedisCluster for ``redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]``: any listed node
        that answers gives the slot map, so listing several survives the loss of one."""
        from urllib.parse import unquote, urlsplit

        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode
        from redis.retry import Retry

        parts = urlsplit(self.url)
        username, _, password = parts.netloc.rpartition("@")[0].partition(":")
        return self._redis.RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self._cluster_nodes],
            username=unquote(username) or None, password=unquote(password) or None,
            ssl=parts.scheme.startswith("rediss"), socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s, retry=Retry(NoBackoff(), 1))

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        self.num_errors += 1
        self._down_until = time.monotonic() + self.retry_s

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys or not self.available:
            return [None] * len(keys)
        try:
            names = [self.prefix + key.hex().encode() for key in keys]
            return list(self.client.mget_nonatomic(names) if self.cluster else self.client.mget(names))
        except self._errors:
            self._failed()
            return [None] * len(keys)

    def has_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys exist (one pipelined EXISTS each, split by slot on a cluster): a hybrid's state lookup asks
        for many positions and reads only the deepest record, megabytes."""
        if not keys or not self.available:
            return [False] * len(keys)
        try:
            pipeline = self.client.pipeline(transaction=False)
            for key in keys:
                pipeline.exists(self.prefix + key.hex().encode())
            return [bool(found) for found in pipeline.execute()]
        except self._errors:
            self._failed()
            return [False] * len(keys)

    def put(self, key: bytes, record: bytes) -> bool:
        """Store ``record``; False while Redis is away (nothing is retried: the block is just not there)."""
        if not self.available:
            return False
        try:
            self.client.set(self.prefix + key.hex().encode(), record)
            return True
        except self._errors:
            self._failed()
            return False

    def delete(self, key: bytes) -> None:
        if not self.available:
            return
        try:
            self.client.delete(self.prefix + key.hex().encode())
        except self._errors:
            self._failed()

    def clear(self) -> int:
        if not self.available:
            return 0
        try:
            keys = list(self.client.scan_iter(match=self.prefix + b"*", count=1000))
            if keys:
                self.client.delete(*keys)
            return len(keys)
        except self._errors:
            self._failed()
            return 0
