"""What the shared index needs of its Redis user, checked once before the server starts.

``check_rights(cfg, keys)`` answers, in one line, the first reason the configured user
could not run the index, or nothing:

1. **reach and log in** (``PING``): unreachable, refused credentials (wrong or missing
   password, unknown ACL user, a disabled user);
2. **load and run scripts** (``SCRIPT LOAD`` every index script, ``SCRIPT EXISTS``,
   ``EVALSHA`` a probe);
3. **every command on the namespace's keys**: the probe script runs each command the
   index's scripts and pipelines send (``COMMANDS``) with ``redis.pcall`` on a probe key
   of this server inside the namespace (``histate:{deployment:model}:probe:<instance>``,
   deleted at the end), and returns the ones Redis refused, for the command or for the
   key. Inside a script Redis applies the caller's ACL to every call, so a user that
   passes the probe may run every script.

The rights the index needs (docs/deployment.md, Security) are therefore
``~histate:* +ping +evalsha +script|load +script|exists`` plus ``COMMANDS`` (redis-py
sends ``SCRIPT EXISTS`` before a pipeline that runs scripts).

NOTE 1 (no ``ACL DRYRUN``): asking Redis what a user may do needs an admin right the
index's user should not have; running the commands on a key of our own asks the same
question with the user's own rights.
"""

from __future__ import annotations

import redis

from lmcache_histate.config import SharedIndexConfig

from .connection import Unavailable, make_client, tls_hint
from .layout import KeySpace
from .scripts import SCRIPTS

__all__ = ["COMMANDS", "RightsRefused", "check_rights", "probe_rights"]

COMMANDS = (
    "GET", "SET", "SETNX", "MGET", "INCRBY", "DECRBY", "DEL", "TIME", "SCAN",
    "HGET", "HMGET", "HSET", "HINCRBY", "HDEL", "HGETALL",
    "ZADD", "ZREM", "ZCARD", "ZCOUNT", "ZRANGE", "ZRANGEBYSCORE", "ZREMRANGEBYSCORE",
)
"""Every Redis command the index sends, in scripts or pipelines (``scripts``, ``index``)."""

# Each command on the probe keys: KEYS[1] a string, KEYS[2] a hash, KEYS[3] a sorted set.
_PROBE = """
local s, h, z = KEYS[1], KEYS[2], KEYS[3]
local calls = {
  {'GET', s}, {'SET', s, '1'}, {'SETNX', s, '1'}, {'MGET', s}, {'INCRBY', s, 1},
  {'DECRBY', s, 1}, {'TIME'}, {'SCAN', 0, 'MATCH', ARGV[1], 'COUNT', 1},
  {'HSET', h, 'f', 1}, {'HGET', h, 'f'}, {'HMGET', h, 'f'}, {'HINCRBY', h, 'f', 1},
  {'HDEL', h, 'f'}, {'HGETALL', h},
  {'ZADD', z, 1, 'm'}, {'ZCARD', z}, {'ZCOUNT', z, 0, 1}, {'ZRANGE', z, 0, 0},
  {'ZRANGEBYSCORE', z, 0, 1}, {'ZREMRANGEBYSCORE', z, 2, 3}, {'ZREM', z, 'm'},
  {'DEL', s, h, z},
}
local refused = {}
for _, c in ipairs(calls) do
  local r = redis.pcall(unpack(c))
  if type(r) == 'table' and r.err then
    local e = string.lower(r.err)
    if string.find(e, 'noperm', 1, true) or string.find(e, "can't", 1, true) then
      local what = 'command'
      if string.find(e, 'key', 1, true) then what = 'key' end
      table.insert(refused, c[1] .. ':' .. what)
    end
  end
end
redis.pcall('DEL', s, h, z)
return refused
"""


class RightsRefused(redis.exceptions.NoPermissionError):
    """The probe script found commands (or keys) the user may not use."""


def probe_rights(client: redis.Redis, keys: KeySpace, instance: str) -> None:
    """Run the probe script (loading it if Redis lost it); raise ``RightsRefused`` naming
    what was refused, or the Redis error of loading or running the script.

    Also the shared index's recovery probe (``IndexConnection.probe``).
    """
    probe = keys.prefix + f"probe:{instance}"
    sha = client.script_load(_PROBE)
    client.script_exists(sha)  # redis-py asks it before a pipeline that runs scripts
    refused = client.evalsha(sha, 3, probe, probe + ":h", probe + ":z", keys.object_pattern)
    if refused:
        commands = sorted({r.partition(":")[0] for r in refused if r.endswith(":command")})
        on_keys = sorted({r.partition(":")[0] for r in refused if r.endswith(":key")})
        parts = []
        if commands:
            parts.append("may not run " + ", ".join(commands))
        if on_keys:
            parts.append(f"may not use keys {keys.prefix}* with " + ", ".join(on_keys))
        raise RightsRefused("user " + "; ".join(parts))


def _login(client: redis.Redis, where: str, cfg: SharedIndexConfig) -> None:
    try:
        client.ping()
    except redis.AuthenticationError:
        raise Unavailable(
            f"shared_index: Redis at {where} refused the credentials (wrong or missing "
            "password, or an unknown or disabled user: check the URL's user and "
            "shared_index.password_file)"
        ) from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise Unavailable(
                f"shared_index: Redis at {where} refused the credentials (wrong or missing "
                "password: check shared_index.password_file)"
            ) from None
        raise Unavailable(f"shared_index: Redis at {where} refused PING: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise Unavailable(
            f"shared_index: Redis at {where} is unreachable ({type(exc).__name__}); "
            "check shared_index.url and that Redis runs" + tls_hint(exc, cfg)
        ) from None


def check_rights(cfg: SharedIndexConfig, keys: KeySpace) -> None:
    """Raise ``connection.Unavailable`` (one line, no credential) unless the configured
    user can run the shared index on ``keys`` (module docstring)."""
    from lmcache_histate.config import redacted_url

    where = redacted_url(cfg.url)
    client = make_client(cfg)
    try:
        _login(client, where, cfg)
        user = cfg.url.partition("://")[2].partition("@")[0] if "@" in cfg.url else "default"
        grant = f"(grant the user {user!r} the rights in docs/deployment.md, Security)"
        try:
            for src in (*SCRIPTS.values(), _PROBE):
                client.script_load(src)
        except redis.exceptions.NoPermissionError:
            raise Unavailable(
                f"shared_index: Redis at {where}: user may not run SCRIPT LOAD {grant}"
            ) from None
        try:
            probe_rights(client, keys, cfg.instance)
        except RightsRefused as exc:
            raise Unavailable(f"shared_index: Redis at {where}: {exc} {grant}") from None
        except redis.exceptions.NoPermissionError as exc:
            text = str(exc).lower()
            what = (f"use keys {keys.prefix}*" if "key" in text
                    else "run SCRIPT EXISTS" if "exists" in text else "run EVALSHA")
            raise Unavailable(f"shared_index: Redis at {where}: user may not {what} {grant}"
                              ) from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise Unavailable(
            f"shared_index: Redis at {where} is unreachable ({type(exc).__name__}); "
            "check shared_index.url and that Redis runs" + tls_hint(exc, cfg)
        ) from None
    finally:
        client.close()
