"""Patches of LMCache 0.5.6's ZMQ request server: a malformed frame must not stop it, and
it must stop without tracebacks. Installed by the launcher (``launcher.run``), never at import.

:func:`install_request_loop_guard` patches three upstream functions (the bugs, with a
reproduction, are written up for upstream in docs/reliability.md, "Upstream issue: one ZMQ
frame stops the request thread"):

1. ``lmcache/v1/multiprocess/transport/zmq_impl/mq.py: MessageQueueServer._main_loop`` --
   the loop of the ``mq-server-thread``, the one thread that reads every engine request.
   It ends each received message with ``assert len(msg) >= 3, "Expected at least 3 message
   parts ..."`` outside any ``try``: a DEALER that sends one frame (any local user can)
   raises ``AssertionError`` out of the loop, the thread dies, the process lives and every
   later RPC times out. The replacement runs the original loop again after that one error
   (the offending message was already consumed by ``recv_multipart``; the loop keeps all of
   its state on ``self``: poller, streams, output queue), reporting the drop through
   ``report``. Any other exception still ends the thread, logged once as CRITICAL; the
   launcher's health check (``backends/server/data_plane.py``) then fails.
2. ``mq.py``'s module names ``decode_operation`` and ``unwrap_request_payloads`` (the
   operation id and the payloads of a request): their decode errors are raised as
   :class:`MalformedRequest` (a ``ValueError``, so the loop's own ``except`` clauses still
   catch them). Upstream logs each with a full traceback (``logger.exception``); the
   launcher's log filter (``backends/server/quiet_log.py``) turns a record whose exception is
   a :class:`MalformedRequest` into one rate-limited line. Nothing else changes: a request
   with garbage payloads gets no answer, as before.
3. ``lmcache/v1/platform/event_notifier.py: EventfdNotifier.notify`` -- its class invariant
   says every method treats a closed notifier (``_efd == -1``) as closed, but ``notify``
   writes to ``-1``. At shutdown ``MessageQueueServer.close`` closes the notifier while a
   pool thread still finishes a request, whose ``_notify_response`` callback then logs
   ``ValueError: file descriptor cannot be a negative integer (-1)`` with a traceback (4 on
   a SIGTERM under load). The replacement returns at once when closed: the response has
   nowhere to go, the loop that would send it has ended.

Versions checked: lmcache 0.5.6 (``patching.CHECKED_VERSIONS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .patching import patch

__all__ = ["MalformedRequest", "install_request_loop_guard"]


class MalformedRequest(ValueError):
    """A request frame the server cannot decode (a client's fault, not the server's)."""


def _malformed(what: str) -> Callable[[Any], Any]:
    """A ``patch`` builder: ``original``'s decode errors raised as :class:`MalformedRequest`."""

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def decode(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except MalformedRequest:
                raise
            except (TypeError, ValueError) as exc:
                raise MalformedRequest(f"{what}: {type(exc).__name__}: {exc}"[:300]) from None

        return decode

    return make


def install_request_loop_guard(
    report: Callable[[str], None], on_death: Callable[[BaseException], None]
) -> None:
    """Keep the request thread alive through malformed frames (module docstring). Idempotent.

    Args:
        report: Called with a one-line reason for every frame dropped by the loop guard.
        on_death: Called with the exception that ends the request thread otherwise.
    """
    from lmcache.v1.multiprocess.transport.zmq_impl import mq
    from lmcache.v1.platform import event_notifier

    def make_loop(original: Any) -> Any:
        @functools.wraps(original)
        def _main_loop(self: Any) -> None:
            while True:
                try:
                    original(self)
                    return
                except AssertionError as exc:  # the message-part check (docstring, 1)
                    report(f"dropped a request with too few frames ({exc})")
                except BaseException as exc:
                    if not self.is_finished.is_set():
                        on_death(exc)
                    return

        return _main_loop

    patch(mq.MessageQueueServer, "_main_loop", make_loop, package="lmcache",
          mark="_histate_request_loop_guard")
    patch(mq, "decode_operation", _malformed("operation id"),
          package="lmcache", mark="_histate_malformed_operation")
    patch(mq, "unwrap_request_payloads", _malformed("payloads"),
          package="lmcache", mark="_histate_malformed_payloads")

    notifier = getattr(event_notifier, "EventfdNotifier", None)
    if notifier is not None and hasattr(notifier, "notify"):

        def make_notify(original: Any) -> Any:
            @functools.wraps(original)
            def notify(self: Any) -> None:
                if getattr(self, "_efd", 0) < 0:
                    return  # closed (docstring, 3)
                original(self)

            return notify

        patch(notifier, "notify", make_notify, package="lmcache",
              mark="_histate_notify_after_close")
