-- Leases of a guarded lane shared by every replica on one Redis.
--
-- KEYS[1] global leases   (zset: lease id -> expiry, ms on the server clock)
-- KEYS[2] batch leases    (zset: lease id -> expiry)
-- KEYS[3] the workspace's single-call leases (zset: lease id -> expiry)
-- KEYS[4] the workspace's starts            (zset: lease id -> start time)
-- All keys share the lane's hash tag, so one script touches one slot.
--
-- ARGV[1] op: take_single | take_batch | renew | release | cancel | counts
-- ARGV[2] lease id
-- ARGV[3] lease ttl (ms)
-- ARGV[4] workspace in-flight limit
-- ARGV[5] workspace starts limit
-- ARGV[6] start window (ms)
-- ARGV[7] global cap
-- ARGV[8] batch cap
-- ARGV[9] now (ms, optional): decide at this time instead of the server's
--         clock (tests driving the memory ledger and this script on one
--         fake clock; keys still expire on the server's clock)
--
-- take_*  -> {1, now} | {0, reason, retry_after_ms[, may_free]}
-- renew   -> number of lease entries still held (0: the lease expired)
-- release -> number of lease entries removed
-- cancel  -> as release, and the lease's start leaves the window (never sent)
-- counts  -> {global, batch, workspace running, workspace starts}

local now = tonumber(ARGV[9])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local op = ARGV[1]
local id = ARGV[2]
local ttl = tonumber(ARGV[3])
local in_flight = tonumber(ARGV[4])
local starts_limit = tonumber(ARGV[5])
local window = tonumber(ARGV[6])
local cap = tonumber(ARGV[7])
local batch_cap = tonumber(ARGV[8])

-- A lease whose replica stopped renewing it is gone: its place comes back.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
-- A start counts while start + window > now.
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - window)

local keep = math.max(ttl, window) + 1000

if op == 'take_single' then
  if redis.call('ZCARD', KEYS[3]) >= in_flight then
    return {0, 'workspace_in_flight_limit', 0}
  end
  if redis.call('ZCARD', KEYS[4]) >= starts_limit then
    local oldest = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
    -- A start of a call still holding its place may yet be given back.
    local may_free = 0
    for _, lease in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
      if redis.call('ZSCORE', KEYS[4], lease) then may_free = 1 break end
    end
    return {0, 'workspace_rate_limit', tonumber(oldest[2]) + window - now, may_free}
  end
  if redis.call('ZCARD', KEYS[1]) >= cap then
    return {0, 'busy', 0}
  end
  redis.call('ZADD', KEYS[1], now + ttl, id)
  redis.call('ZADD', KEYS[3], now + ttl, id)
  redis.call('ZADD', KEYS[4], now, id)
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], keep) end
  return {1, now}
elseif op == 'take_batch' then
  if redis.call('ZCARD', KEYS[1]) >= cap or redis.call('ZCARD', KEYS[2]) >= batch_cap then
    return {0, 'busy', 0}
  end
  redis.call('ZADD', KEYS[1], now + ttl, id)
  redis.call('ZADD', KEYS[2], now + ttl, id)
  redis.call('PEXPIRE', KEYS[1], keep)
  redis.call('PEXPIRE', KEYS[2], keep)
  return {1, now}
elseif op == 'renew' then
  local held = 0
  for i = 1, 3 do
    if redis.call('ZSCORE', KEYS[i], id) then
      held = held + 1
      redis.call('ZADD', KEYS[i], 'XX', now + ttl, id)
      redis.call('PEXPIRE', KEYS[i], keep)
    end
  end
  return held
elseif op == 'release' then
  local removed = 0
  for i = 1, 3 do removed = removed + redis.call('ZREM', KEYS[i], id) end
  return removed
elseif op == 'cancel' then
  local removed = 0
  for i = 1, 3 do removed = removed + redis.call('ZREM', KEYS[i], id) end
  -- Only a lease still held takes its start back: an expired one may have
  -- been counted against by another call already.
  if removed > 0 then redis.call('ZREM', KEYS[4], id) end
  return removed
elseif op == 'counts' then
  return {
    redis.call('ZCARD', KEYS[1]),
    redis.call('ZCARD', KEYS[2]),
    redis.call('ZCARD', KEYS[3]),
    redis.call('ZCARD', KEYS[4]),
  }
end
return redis.error_reply('unknown op ' .. tostring(op))
