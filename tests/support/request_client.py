"""LMCache request clients for tests, each on its own ZMQ context.

NOTE 1: lmcache 0.5.6's ``MessageQueueClient`` (``transport/zmq_impl/mq.py``) watches its
DEALER socket with pyzmq's ``get_monitor_socket``, whose inproc endpoint is named after the
socket's file descriptor (``inproc://monitor.s-<FD>``), and by default every client lives on
the process-wide ``zmq.Context.instance()``. libzmq unbinds that endpoint on its reaper thread,
after ``close()`` has returned; a client created right after another was closed can be given
the same descriptor while the old endpoint is still bound, and its constructor raises
``ZMQError: Address already in use``. CI hit this once under load, in
``test_engine_reconnects_do_not_grow_server_mappings`` (25 engines connect in a row). A
production engine opens one client per worker and keeps it, so only tests that reconnect
meet the race. inproc names are per context: a context per client cannot collide.

NOTE 2: the context's LINGER is 0 so that terminating it never waits for a message to a
server that a fault test killed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq
from lmcache.v1.multiprocess.transport.base import RequestClient
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory


class OwnedRequestClient:
    """A ``RequestClient`` and the ZMQ context it alone uses; :meth:`close` ends both."""

    def __init__(self, zmq_url: str) -> None:
        self.context = zmq.Context()
        self.context.setsockopt(zmq.LINGER, 0)
        try:
            self.client: RequestClient = RequestClientFactory.create(zmq_url, context=self.context)
        except BaseException:
            self.context.term()
            raise

    def close(self) -> None:
        """Close the client's sockets, then the context (returns at once: LINGER 0)."""
        try:
            self.client.close()
        finally:
            self.context.term()


@contextlib.contextmanager
def request_client(zmq_url: str) -> Iterator[RequestClient]:
    """One client for the ``with`` block, closed with its context on exit."""
    owned = OwnedRequestClient(zmq_url)
    try:
        yield owned.client
    finally:
        owned.close()
