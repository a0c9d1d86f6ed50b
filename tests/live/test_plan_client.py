"""``PendingPlan`` (``backends/vllm/plan_client.py``): one answer per plan request.

The connector keeps a request's plan in flight until the request is released and takes
its answer again when the same segment is planned after a failed allocation (connector
NOTE 7), so a second :meth:`PendingPlan.result` must not wait, ask or count again. The
future stands in for LMCache's messaging future (``query`` / ``result``), whose failures
cannot be caused on demand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lmcache_histate.backends.vllm.plan_client import PendingPlan


@dataclass
class Response:
    success: bool
    payload: bytes = b""
    error: str = ""


class Future:
    def __init__(self, response: Response | Exception) -> None:
        self.response = response
        self.calls = 0

    def query(self) -> bool:
        return True

    def result(self, timeout: float) -> Response:
        self.calls += 1
        if isinstance(self.response, Exception):
            raise self.response
        return self.response


def test_a_second_result_returns_the_first_answer_without_waiting() -> None:
    counts: list[str] = []
    future = Future(Response(True, json.dumps({"boundaries": [384, 768]}).encode()))
    plan = PendingPlan(future, 5.0, counts.append)
    assert not plan.taken
    assert plan.result() == [384, 768]
    assert plan.taken and plan.ready()
    assert plan.result() == [384, 768]
    assert future.calls == 1 and counts == []


def test_a_failed_call_is_counted_once() -> None:
    counts: list[str] = []
    future = Future(TimeoutError("no answer"))
    plan = PendingPlan(future, 5.0, counts.append)
    assert plan.result() is None
    assert plan.result() is None
    assert future.calls == 1 and counts == ["plan_errors"]
