"""Read-ahead for the training stream: a daemon thread iterates a source up to `depth` items ahead
(`Prefetcher`), or several threads each read one of the next `depth` items (`OrderedReadAhead`, for a cache whose
every read is a round trip to a remote store: their waits overlap).

Errors are carried to the consumer's thread; every live thread is stopped and joined at exit, before the
interpreter shuts down.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

_END = object()


class Prefetcher:
    """Iterates `source` in a daemon thread, up to `depth` items ahead; errors are raised in `__next__`.

    The thread stops once the consumer is done with this object (`close`, or garbage collection), and
    drops `source` itself (for a DataLoader iterator: shuts its workers down) before it ends.
    """

    def __init__(self, source: Iterator, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        # The thread gets the queue, the event and the source (in a list it empties, so that it holds the
        # only reference), never `self`, so `self` can be collected while the thread runs.
        self._thread = threading.Thread(
            target=_fill, args=([source], self._queue, self._stop), name="qie-prefetch", daemon=True
        )
        _LIVE[self._thread] = self._stop
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        ok, item = self._queue.get()
        if ok:
            return item
        self._done = True
        if item is _END:
            raise StopIteration
        raise item

    def close(self) -> None:
        """Stop the thread (it finishes the item it is taking) and drop what it read ahead."""
        self._done = True
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class OrderedReadAhead:
    """`read(item)` for each item of `items`, in their order, with up to `depth` reads running ahead on `depth`
    threads: each read's wait (a remote store's round trips) overlaps the others' and the consumer's work.
    An error of a read is raised in `__next__` when its turn comes; `close` cancels the reads not started."""

    def __init__(self, items: Iterable, read: Callable, depth: int) -> None:
        self._items, self._read, self._depth = iter(items), read, max(1, depth)
        self._pool = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="qie-read-ahead")
        self._pending: collections.deque[Future] = collections.deque()
        self._exhausted = False
        _POOLS.add(self._pool)

    def __iter__(self) -> OrderedReadAhead:
        return self

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self._depth:
            try:
                item = next(self._items)
            except StopIteration:
                self._exhausted = True
                return
            self._pending.append(self._pool.submit(self._read, item))

    def __next__(self):
        self._fill()
        if not self._pending:
            self.close()
            raise StopIteration
        result = self._pending.popleft().result()
        self._fill()  # the next read starts before the consumer takes this one
        return result

    def close(self) -> None:
        self._exhausted = True
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        _POOLS.discard(self._pool)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


# Read-ahead pools still open: waited for at exit (a read inside torch code while Python finalizes aborts it).
_POOLS: set[ThreadPoolExecutor] = set()


# Running prefetch threads. At exit they are stopped and joined before the interpreter shuts down: a daemon
# thread still inside torch code (a DataLoader shutting its workers down) when Python finalizes aborts the
# process ("terminate called without an active exception").
_LIVE: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_prefetchers() -> None:
    for pool in list(_POOLS):
        pool.shutdown(wait=True, cancel_futures=True)
    live = list(_LIVE.items())
    for _, stop in live:
        stop.set()
    for thread, _ in live:
        thread.join(timeout=30.0)


def _fill(holder: list, out: queue.Queue, stop: threading.Event) -> None:
    source = holder.pop()
    try:
        for item in source:
            if not _put(out, stop, (True, item)):
                return
        _put(out, stop, (False, _END))
    except BaseException as e:  # handed to the consumer, raised in its thread
        _put(out, stop, (False, e))
    finally:
        item = None
        del source  # the last reference: a DataLoader iterator shuts its workers down here, in this thread
        _LIVE.pop(threading.current_thread(), None)


def _put(out: queue.Queue, stop: threading.Event, value: tuple) -> bool:
    """Put `value` once there is room; False (nothing put) when the consumer stopped meanwhile."""
    while not stop.is_set():
        try:
            out.put(value, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
