"""``POST /histate/resume``: how much of a prompt this node can resume, for a router.

A router in front of several vLLM nodes asks each node's ``histate-server`` with the
prompt's token ids (the ones vLLM would send to LMCache: the tokenized prompt) and sends
the request to the node with the deepest ``resumable_tokens``, the load decides between
equals (docs/multi-node.md, "Routing")::

    POST /histate/resume  {"token_ids": [...], "cache_salt": ""}
    -> {"instance": "node-a", "chunk_tokens": 384, "kv_tokens": 3456,
        "resumable_tokens": 2688, "shared_tier": "connected"}

``resumable_tokens`` counts only chunk boundaries with a snapshot behind them: the deepest
boundary within the node's own KV prefix (CPU or disk tier) whose recurrent state the
node holds, as the policy core's ``lookup`` matches a LOOKUP (``core/index.py``
``Match.hit_chunks``). ``kv_tokens`` is the KV prefix alone: a router that counts KV
blocks without a snapshot (what a KV-event index sees) would credit the node with it
and over-count the hit. What the shared tier holds, every node of the deployment can load,
so it does not tell nodes apart and is not part of the answer.

The answer is computed under the runtime lock from the core's index (no I/O, no
Redis); the work is one hash per chunk of the prompt, bounded by ``max_model_tokens``
like every HiState request (``plugins`` NOTE 1). The route is installed on LMCache's
FastAPI app before the server starts (``launcher.run``), so ``access``'s body limit and,
with ``auth_token_file``, its bearer guard cover it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from .access import RpcRefused
from .runtime.runtime import HiStateRuntime

__all__ = ["RESUME_PATH", "install_routing_api", "parse_resume_request"]

RESUME_PATH = "/histate/resume"


def parse_resume_request(body: Any, max_tokens: int) -> tuple[list[int], str]:
    """``(token_ids, cache_salt)`` of a request body, each checked."""
    if not isinstance(body, dict):
        raise RpcRefused(f"{RESUME_PATH}: the body must be a JSON object")
    tokens = body.get("token_ids")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise RpcRefused(f"{RESUME_PATH}: token_ids must be a list of token ids (integers >= 0)")
    if len(tokens) > max_tokens:
        raise RpcRefused(f"{RESUME_PATH}: {len(tokens)} token_ids, at most {max_tokens} "
                         f"(max_model_tokens)")
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str):
        raise RpcRefused(f"{RESUME_PATH}: cache_salt must be a string")
    return tokens, salt


def install_routing_api(app: Any, runtime: HiStateRuntime) -> None:
    """Add ``POST /histate/resume`` to LMCache's FastAPI ``app``."""

    async def resume(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": f"{RESUME_PATH}: the body is not JSON"}, 400)
        try:
            tokens, salt = parse_resume_request(body, runtime.cfg.max_model_tokens)
        except RpcRefused as exc:
            return JSONResponse({"error": str(exc)}, 400)
        return JSONResponse(runtime.resumable(tokens, salt))

    app.add_api_route(RESUME_PATH, resume, methods=["POST"])
