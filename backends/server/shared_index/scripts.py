"""The shared index's Lua scripts: every state change of an entry is one atomic script.

Redis runs a script alone, so a script that reads an entry and changes it cannot race
another server's script: that is what makes "no object evicted twice" and "no file
deleted under a lease" hold (``claim`` checks the leases and moves the entry out of
``stored`` in the same step; ``lookup`` leases only ``stored`` entries). Each script
declares the namespace's ``used`` key as ``KEYS[1]`` and derives the prefix from it
(``layout`` NOTE 1). Times come from Redis (``TIME``), so servers' clocks never meet.

``H`` is computed in Redis with the same formula as ``lmcache_histate/core/rank.py``
(``H = t + tau * ln(max(C/M, MIN_RATIO))``, ``tau <= 0`` gives ``t``): the owner publishes
``C`` and ``M``, a lookup refreshes ``t``, and ``tau`` is either fixed (a number ``>= 0``)
or the deployment's re-access gap EMA (``tau < 0`` = auto). NOTE 1 (lazy re-rank, as the
core's ``EvictionQueue.victim``): ``tau`` drifts; queued scores are not recomputed for
it. ``claim`` recomputes the lowest entry's ``H`` and, when it rose, re-queues it and
looks again, so drift delays a unit by at most the drift of its own ``H``.

NOTE 2 (lease keys carry no TTL): a lease is a member of the object's lease set scored by
its expiry; ``claim`` drops expired members before it counts live ones, and the set is
deleted with its entry (``drop``, ``forget``). So a lease set lives at most as long as its
object and holds at most one member per server; setting a key expiry on every lease
would cost two more commands per object on the lookup path.

NOTE 3 (``C`` over the deployment): ``C`` is a sum over the sessions whose hits need a
unit (``core/units.expected_recompute``), so the deployment's ``C`` of an object is the
sum of what each server's core counts for the sessions it serves. Each server publishes
its share (field ``c:<instance>``, set by ``commit`` for the owner and by ``rescore``
for any server whose core holds the object) and ``cost`` is kept equal to the sum of
the shares; ``M`` is the last publisher's (the same unit's bytes in every core that
holds it). A session that moved is counted by both servers until the old one's
session expires (``session_ttl_s``): an over-count bounded by one server's share.

NOTE 4 (an adoption gives way to the writer): a reconcile registers a file without an
entry as its own with ``C = 0`` (``reconcile``), which ranks it first for eviction. When
Redis restarted empty, another server's reconcile can adopt files whose writer has not
re-registered them yet (it is still degraded, or re-registering thousands of objects in
batches). Were the writer's commit to leave such an entry as ``stored``, the files would
stay ranked as nothing needed and be evicted first although sessions need them. So an
adopted entry records its adopter (field ``adopted``), and a commit by any other server,
which wrote the file and knows its chain, takes it over with its own cost and last
access.

Numbers leave Lua as strings (Redis truncates Lua numbers to integers in replies).
"""

from __future__ import annotations

__all__ = ["CLAIM", "COMMIT", "DROP", "FORGET", "HEARTBEAT", "LOOKUP", "LOOKUP_FIELDS",
           "OBSERVE", "RESCORE", "RESERVE", "SCRIPTS", "SESSION"]

_PRELUDE = """
local P = string.sub(KEYS[1], 1, -5)
local MIN_RATIO = 1e-9
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function tau_of(arg)
  local tau = tonumber(arg)
  if tau < 0 then tau = tonumber(redis.call('HGET', P .. 'ema', 'gap') or '0') end
  return tau
end
local function score(t, cost, freed, tau)
  if tau <= 0 then return t end
  local ratio = 0
  if freed > 0 then ratio = cost / freed end
  if not (ratio > MIN_RATIO) then ratio = MIN_RATIO end
  return t + tau * math.log(ratio)
end
local function ema_step(field, value, alpha)
  local ema = P .. 'ema'
  if value < 0 then value = 0 end
  local n = tonumber(redis.call('HGET', ema, field .. '_n') or '0')
  local old = tonumber(redis.call('HGET', ema, field) or '0')
  local new = value
  if n > 0 then new = old + alpha * (value - old) end
  redis.call('HSET', ema, field, new, field .. '_n', n + 1)
  return new
end
"""

RESERVE = _PRELUDE + """
-- ARGV: owner, write_ms, then (id, size, path) per object.
-- Per object: 1 reserved (state writing), 0 present already (stored or being written:
-- write nothing), -1 not reserved: over budget, or being evicted right now (its bytes
-- are not in the deficit; the caller may store it again later). Last element: bytes
-- that must be claimed for the over-budget objects to fit.
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local budget = tonumber(redis.call('GET', P .. 'budget') or '-1')
local out, short = {}, 0
for i = 3, #ARGV, 3 do
  local key, size = P .. 'o:' .. ARGV[i], tonumber(ARGV[i + 1])
  local state = redis.call('HGET', key, 'state')
  if state == 'evicting' then
    out[#out + 1] = -1
  elseif state then
    out[#out + 1] = 0
  elseif budget >= 0 and used + size > budget then
    out[#out + 1] = -1
    short = short + size
  else
    redis.call('HSET', key, 'state', 'writing', 'owner', owner, 'size', size,
               'path', ARGV[i + 2], 'until', now + ttl)
    used = used + size
    out[#out + 1] = 1
  end
end
redis.call('SET', KEYS[1], used)
local deficit = 0
if short > 0 then
  local evicting = tonumber(redis.call('GET', P .. 'evicting') or '0')
  deficit = math.max(0, used + short - budget - evicting)
end
out[#out + 1] = deficit
return out
"""

COMMIT = _PRELUDE + """
-- ARGV: owner, tau, adopting (1/0), then 11 fields per object: id, path, size, crc, kind,
-- depth, parent (hex), cost, freed, tier, oid (hex). Per object: 1 own reservation
-- committed, 2 registered without one (re-registration, adoption), 3 taken back from an
-- adoption by the server that wrote it (NOTE 4), 0 already stored (unchanged).
local owner, tau, adopting = ARGV[1], tau_of(ARGV[2]), ARGV[3] == '1'
local t = now_ms() / 1000
local delta, out = 0, {}
for i = 4, #ARGV, 11 do
  local id = ARGV[i]
  local key = P .. 'o:' .. id
  local size = tonumber(ARGV[i + 2])
  local state = redis.call('HGET', key, 'state')
  local adopter = nil
  if state == 'stored' and not adopting then
    adopter = redis.call('HGET', key, 'adopted')
    if adopter == owner then adopter = nil end
  end
  if (state == 'stored' or state == 'evicting') and not adopter then
    out[#out + 1] = 0
  else
    if state == 'writing' or adopter then
      delta = delta + size - tonumber(redis.call('HGET', key, 'size'))
      out[#out + 1] = adopter and 3 or 1
    else
      delta = delta + size
      out[#out + 1] = 2
    end
    if adopter then redis.call('HDEL', key, 'c:' .. adopter) end
    redis.call('HSET', key, 'state', 'stored', 'owner', owner, 'path', ARGV[i + 1],
               'size', size, 'crc', ARGV[i + 3], 'kind', ARGV[i + 4], 'depth', ARGV[i + 5],
               'parent', ARGV[i + 6], 'cost', ARGV[i + 7], 'freed', ARGV[i + 8],
               'tier', ARGV[i + 9], 'oid', ARGV[i + 10], 't', t, 'born', t,
               'c:' .. owner, ARGV[i + 7])
    redis.call('HDEL', key, 'until', 'claimant')
    if adopting then
      redis.call('HSET', key, 'adopted', owner)
    else
      redis.call('HDEL', key, 'adopted')
    end
    redis.call('ZADD', P .. 'rank',
               score(t, tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8]), tau), id)
  end
end
if delta ~= 0 then redis.call('INCRBY', KEYS[1], delta) end
return out
"""

_LOOKUP_FIELDS = ("path", "size", "crc", "owner", "kind", "depth", "parent", "tier", "oid")
LOOKUP = _PRELUDE + """
-- ARGV: holder, lease_ms, tau, then (id, mode) pairs; mode bit 1 = lease, bit 2 = touch
-- (refresh t and H). Per id: 0 (not stored) or the entry's LOOKUP_FIELDS joined by tabs
-- (one string per object: a reply of 64 strings parses far faster than one of 576).
local holder, lease = ARGV[1], tonumber(ARGV[2])
local tau = nil
local nowms = now_ms()
local out = {}
for i = 4, #ARGV, 2 do
  local id, mode = ARGV[i], tonumber(ARGV[i + 1])
  local key = P .. 'o:' .. id
  local f = redis.call('HMGET', key, 'state', 'cost', 'freed', FIELDS)
  if f[1] == 'stored' then
    if mode % 2 == 1 and lease > 0 then
      redis.call('ZADD', P .. 'lease:' .. id, nowms + lease, holder)  -- NOTE 2
    end
    if mode >= 2 then
      if tau == nil then tau = tau_of(ARGV[3]) end
      local t = nowms / 1000
      redis.call('HSET', key, 't', t)
      redis.call('ZADD', P .. 'rank', score(t, tonumber(f[2]), tonumber(f[3]), tau), id)
    end
    out[#out + 1] = table.concat(f, '\t', 4)
  else
    out[#out + 1] = 0
  end
end
return out
""".replace("FIELDS", ", ".join(f"'{name}'" for name in _LOOKUP_FIELDS))
LOOKUP_FIELDS = _LOOKUP_FIELDS

CLAIM = _PRELUDE + """
-- ARGV: claimant, bytes needed, claim_ms, max entries examined, tau.
-- Moves the lowest-H stored entries that no live lease holds to 'evicting' (owned by
-- the claimant until the deadline) until their sizes reach the bytes needed.
-- Returns {id, path, size} per claimed entry.
local claimant, need = ARGV[1], tonumber(ARGV[2])
local claim_ms, max_scan, tau = tonumber(ARGV[3]), tonumber(ARGV[4]), tau_of(ARGV[5])
local nowms = now_ms()
local rank = P .. 'rank'
local got, pos, scans, out = 0, 0, 0, {}
while got < need and scans < max_scan do
  local top = redis.call('ZRANGE', rank, pos, pos, 'WITHSCORES')
  if #top == 0 then break end
  scans = scans + 1
  local id, queued = top[1], tonumber(top[2])
  local key = P .. 'o:' .. id
  local f = redis.call('HMGET', key, 'state', 't', 'cost', 'freed', 'size', 'path')
  if f[1] ~= 'stored' then
    redis.call('ZREM', rank, id)
  else
    local h = score(tonumber(f[2]), tonumber(f[3]), tonumber(f[4]), tau)
    if h > queued + 1e-6 * math.max(1, math.abs(queued)) then
      redis.call('ZADD', rank, h, id)  -- NOTE 1: re-queued; look at the new lowest
    else
      local lk = P .. 'lease:' .. id
      redis.call('ZREMRANGEBYSCORE', lk, '-inf', nowms)
      if redis.call('ZCARD', lk) > 0 then
        pos = pos + 1
      else
        redis.call('ZREM', rank, id)
        redis.call('HSET', key, 'state', 'evicting', 'claimant', claimant,
                   'until', nowms + claim_ms)
        redis.call('INCRBY', P .. 'evicting', tonumber(f[5]))
        got = got + tonumber(f[5])
        out[#out + 1] = {id, f[6], f[5]}
      end
    end
  end
end
return out
"""

DROP = _PRELUDE + """
-- ARGV: claimant, alpha, ids. The claimant deleted these files: forget the entries it
-- holds claims on, free their bytes, and feed each one's residence time (now - born)
-- to the deployment's EMA of its kind (1 = snapshot -> 'state', else 'kv').
-- Returns the number of entries dropped.
local claimant, alpha = ARGV[1], tonumber(ARGV[2])
local t = now_ms() / 1000
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local key = P .. 'o:' .. id
  local f = redis.call('HMGET', key, 'state', 'claimant', 'size', 'born', 'kind')
  if f[1] == 'evicting' and f[2] == claimant then
    local size = tonumber(f[3])
    redis.call('DECRBY', KEYS[1], size)
    redis.call('DECRBY', P .. 'evicting', size)
    redis.call('DEL', key, P .. 'lease:' .. id)
    if f[4] then
      local field = 'kv'
      if f[5] == '1' then field = 'state' end
      ema_step(field, t - tonumber(f[4]), alpha)
    end
    n = n + 1
  end
end
return n
"""

FORGET = _PRELUDE + """
-- ARGV: mode, taker, claim_ms, ids.
-- mode 'stored': the entry's file is gone or corrupt: forget a stored entry, free its bytes.
-- mode 'expired': an entry whose deadline passed: a 'writing' one is forgotten (its
--   writer died), an 'evicting' one is taken over by the taker (its claimant died).
-- mode 'unreserved': the taker's own reservations ('writing', owner = taker) whose
--   objects it did not write (failed or skipped): forgotten, their bytes freed.
-- Returns {id, state, path} per entry acted on.
local mode, taker, claim_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local nowms = now_ms()
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local key = P .. 'o:' .. id
  local f = redis.call('HMGET', key, 'state', 'size', 'path', 'until', 'owner')
  local expired = f[4] and tonumber(f[4]) < nowms
  if (mode == 'stored' and f[1] == 'stored') or (f[1] == 'writing' and (
      (mode == 'expired' and expired) or (mode == 'unreserved' and f[5] == taker))) then
    redis.call('DECRBY', KEYS[1], tonumber(f[2]))
    redis.call('DEL', key, P .. 'lease:' .. id)
    redis.call('ZREM', P .. 'rank', id)
    out[#out + 1] = {id, f[1], f[3] or ''}
  elseif mode == 'expired' and expired and f[1] == 'evicting' then
    redis.call('HSET', key, 'claimant', taker, 'until', nowms + claim_ms)
    out[#out + 1] = {id, f[1], f[3] or ''}
  end
end
return out
"""

RESCORE = _PRELUDE + """
-- ARGV: tau, publisher, then (id, cost, freed, age) per object: the publisher's C (its
-- share of the deployment's C, NOTE 3), the unit's M, and the seconds since the
-- publisher's last access of it (age < 0: none; freed < 0: M unchanged).
-- cost = sum of the servers' shares; t = max(t, now - age); H re-queued.
-- Returns the number of stored entries updated.
local tau = tau_of(ARGV[1])
local share = 'c:' .. ARGV[2]
local now = now_ms() / 1000
local n = 0
for i = 3, #ARGV, 4 do
  local id = ARGV[i]
  local key = P .. 'o:' .. id
  local f = redis.call('HMGET', key, 'state', 't', 'cost', share, 'freed')
  if f[1] == 'stored' then
    local mine, freed, age = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    if freed < 0 then freed = tonumber(f[5] or '0') end
    local cost = tonumber(f[3] or '0') - tonumber(f[4] or '0') + mine
    if cost < 0 then cost = 0 end
    local t = tonumber(f[2])
    if age >= 0 and now - age > t then t = now - age end
    redis.call('HSET', key, 'cost', cost, share, ARGV[i + 1], 'freed', freed, 't', t)
    redis.call('ZADD', P .. 'rank', score(t, cost, freed, tau), id)
    n = n + 1
  end
end
return n
"""

HEARTBEAT = _PRELUDE + """
-- ARGV: instance, window (s). This server is alive now; returns {the servers seen alive
-- within the window (itself included), the deployment's used bytes, the epoch token or
-- '' when Redis lost it (index NOTE 1)}.
local now = now_ms() / 1000
redis.call('ZADD', P .. 'servers', now, ARGV[1])
return {redis.call('ZCOUNT', P .. 'servers', now - tonumber(ARGV[2]), '+inf'),
        tonumber(redis.call('GET', KEYS[1]) or '0'),
        redis.call('GET', P .. 'epoch') or ''}
"""

OBSERVE = _PRELUDE + """
-- ARGV: alpha, then (field, value) pairs: seeded EMA steps (core/ema.seeded_step).
-- Returns the new values as strings.
local alpha = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, 2 do
  out[#out + 1] = tostring(ema_step(ARGV[i], tonumber(ARGV[i + 1]), alpha))
end
return out
"""

SESSION = _PRELUDE + """
-- ARGV: session id, owner, end object id, end tokens, alpha, begin (1/0).
-- begin = 1: a request of the session begins at this server: the gap since its previous
-- access (at any server) feeds the deployment's re-access EMA ('gap'), the session's
-- owner and last access are updated. A non-empty end id records the session's final
-- snapshot (its request stored it). Returns the facts before the call:
-- {owner, end, end_tokens, gap} (empty strings for a new session / no gap).
local sid, owner, end_id, alpha = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5])
local key = P .. 's:' .. sid
local t = now_ms() / 1000
local f = redis.call('HMGET', key, 'owner', 'end', 'end_tokens', 't')
local gap = ''
if ARGV[6] == '1' then
  if f[4] then
    gap = tostring(t - tonumber(f[4]))
    ema_step('gap', t - tonumber(f[4]), alpha)
  end
  redis.call('HSET', key, 'owner', owner, 't', t)
  redis.call('HINCRBY', key, 'requests', 1)
  redis.call('ZADD', P .. 'sessions', t, sid)
end
if end_id ~= '' then redis.call('HSET', key, 'end', end_id, 'end_tokens', ARGV[4]) end
return {f[1] or '', f[2] or '', f[3] or '', gap}
"""

SCRIPTS = {
    "reserve": RESERVE, "commit": COMMIT, "lookup": LOOKUP, "claim": CLAIM, "drop": DROP,
    "forget": FORGET, "rescore": RESCORE, "observe": OBSERVE, "session": SESSION,
    "heartbeat": HEARTBEAT,
}
