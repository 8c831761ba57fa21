-- The batch queue: every operation of sluice_store::RedisBatches, atomically.
--
-- KEYS[1] the key prefix P (ends in a hash tag, so every key below shares one
--         cluster slot); ARGV[1] the operation; times are Unix milliseconds.
--
-- P..'b:'..id   hash  the batch: ws, hk (has key), key, digest, total, done,
--                     failed, queued, running, created, first, finished,
--                     origin, bytes (of its bodies and results stored now)
-- P..'i:'..id   hash  its items: s:<i> state (0 queued, 1 running, 2 done,
--                     3 failed), a:<i> attempt, p:<i> queue place, c:<i> claimed,
--                     b:<i> body (until finished), r:<i> result
-- P..'q:'..ws   zset  the workspace's queued items, "<id>/<i>" by place
-- P..'run'      zset  running items, "<id>/<i>" by lease end
-- P..'wq', P..'wr', P..'wl'  hashes  per workspace: queued, running, last claim
-- P..'keys'     hash  "<#ws>:<ws><key>" -> batch id
-- P..'fin'      zset  finished batches by finish time
-- P..'ou', P..'ob'  hashes  per origin: unfinished items, stored bytes
-- P..'stats'    hash  seq (next queue place), stored (items), mean (ms),
--                     unfinished (items), bytes (stored)
-- P..'void:'..id  string  a submit whose answer was lost and that had not
--                     stored its batch when asked ('settle'): it stores
--                     nothing should it still arrive; expires

local P = KEYS[1]
local op = ARGV[1]

local function member(id, i)
  return id .. '/' .. i
end

local function split(m)
  local id, i = string.match(m, '^(.*)/(%d+)$')
  return id, tonumber(i)
end

local function keyfield(ws, key)
  return #ws .. ':' .. ws .. key
end

local function num(v)
  return tonumber(v) or 0
end

-- A running item back at its place in its workspace's queue.
local function requeue(id, i)
  local m = member(id, i)
  redis.call('ZREM', P .. 'run', m)
  local items = P .. 'i:' .. id
  if redis.call('HGET', items, 's:' .. i) ~= '1' then
    return 0
  end
  redis.call('HSET', items, 's:' .. i, '0')
  local batch = P .. 'b:' .. id
  local ws = redis.call('HGET', batch, 'ws')
  redis.call('HINCRBY', batch, 'running', -1)
  redis.call('HINCRBY', batch, 'queued', 1)
  redis.call('ZADD', P .. 'q:' .. ws, num(redis.call('HGET', items, 'p:' .. i)), m)
  redis.call('HINCRBY', P .. 'wq', ws, 1)
  redis.call('HINCRBY', P .. 'wr', ws, -1)
  return 1
end

local function forget_workspace_if_idle(ws)
  if num(redis.call('HGET', P .. 'wq', ws)) <= 0 and num(redis.call('HGET', P .. 'wr', ws)) <= 0 then
    redis.call('HDEL', P .. 'wq', ws)
    redis.call('HDEL', P .. 'wr', ws)
    redis.call('HDEL', P .. 'wl', ws)
  end
end

if op == 'submit' then
  -- ws, has_key, key, digest, id, now, max_backlog, max_stored, n, origin,
  -- max_queued, max_bytes, origin_share, bodies...
  local ws, has_key, key, digest, id = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  local now, max_backlog, max_stored, n = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  local origin, max_queued, max_bytes = ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13])
  local share = math.max(tonumber(ARGV[14]), 1)
  local first_body = 15
  if redis.call('EXISTS', P .. 'void:' .. id) == 1 then
    return {6}
  end
  if has_key == '1' then
    local existing = redis.call('HGET', P .. 'keys', keyfield(ws, key))
    if existing then
      local b = redis.call('HMGET', P .. 'b:' .. existing, 'digest', 'total')
      if b[1] == digest then
        return {1, existing, num(b[2])}
      end
      return {2, existing}
    end
  end
  local unfinished = num(redis.call('HGET', P .. 'wq', ws)) + num(redis.call('HGET', P .. 'wr', ws))
  if unfinished + n > max_backlog then
    return {3, unfinished, max_backlog}
  end
  local stored = num(redis.call('HGET', P .. 'stats', 'stored'))
  if stored + n > max_stored then
    return {4, stored, max_stored}
  end
  -- The global bounds, then the origin's share of each (as BatchConfig::queue_bound).
  local bytes = 0
  for i = 0, n - 1 do
    bytes = bytes + string.len(ARGV[first_body + i])
  end
  local queued_all = num(redis.call('HGET', P .. 'stats', 'unfinished'))
  local bytes_all = num(redis.call('HGET', P .. 'stats', 'bytes'))
  if queued_all + n > max_queued then
    return {5, 0, queued_all, max_queued}
  end
  if bytes_all + bytes > max_bytes then
    return {5, 1, bytes_all, max_bytes}
  end
  if origin ~= '' then
    local o_items = num(redis.call('HGET', P .. 'ou', origin))
    local o_bytes = num(redis.call('HGET', P .. 'ob', origin))
    local o_max_items = math.floor(max_queued / share)
    local o_max_bytes = math.floor(max_bytes / share)
    if o_items + n > o_max_items then
      return {5, 2, o_items, o_max_items}
    end
    if o_bytes + bytes > o_max_bytes then
      return {5, 3, o_bytes, o_max_bytes}
    end
    redis.call('HINCRBY', P .. 'ou', origin, n)
    redis.call('HINCRBY', P .. 'ob', origin, bytes)
  end
  redis.call('HINCRBY', P .. 'stats', 'unfinished', n)
  redis.call('HINCRBY', P .. 'stats', 'bytes', bytes)
  local first = redis.call('HINCRBY', P .. 'stats', 'seq', n) - n
  redis.call('HINCRBY', P .. 'stats', 'stored', n)
  redis.call('HINCRBY', P .. 'wq', ws, n)
  redis.call('HSET', P .. 'b:' .. id, 'ws', ws, 'hk', has_key, 'key', key, 'digest', digest,
    'total', n, 'done', 0, 'failed', 0, 'queued', n, 'running', 0, 'created', now,
    'first', 0, 'finished', 0, 'origin', origin, 'bytes', bytes)
  if has_key == '1' then
    redis.call('HSET', P .. 'keys', keyfield(ws, key), id)
  end
  local items = P .. 'i:' .. id
  local queue = P .. 'q:' .. ws
  for i = 0, n - 1 do
    redis.call('HSET', items, 's:' .. i, '0', 'a:' .. i, 0, 'p:' .. i, first + i, 'b:' .. i, ARGV[first_body + i])
    redis.call('ZADD', queue, first + i, member(id, i))
  end
  return {0, id, n}

elseif op == 'settle' then
  -- id, void_ms: after a submit of batch id whose answer was lost, whether it
  -- stored the batch (1); if not (0), the id is void for void_ms, so that the
  -- submit, should it still arrive, stores nothing: the answer is final.
  local id, void_ms = ARGV[2], tonumber(ARGV[3])
  if redis.call('EXISTS', P .. 'b:' .. id) == 1 then
    return 1
  end
  redis.call('SET', P .. 'void:' .. id, '1', 'PX', void_ms)
  return 0

elseif op == 'claim' then
  -- ws ('' for the fairest), now, lease
  local ws, now, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  if ws == '' then
    local best, best_running, best_last = nil, nil, nil
    local queued = redis.call('HGETALL', P .. 'wq')
    for k = 1, #queued, 2 do
      local w = queued[k]
      if num(queued[k + 1]) > 0 then
        local running = num(redis.call('HGET', P .. 'wr', w))
        local last = num(redis.call('HGET', P .. 'wl', w))
        if best == nil or running < best_running
          or (running == best_running and (last < best_last or (last == best_last and w < best))) then
          best, best_running, best_last = w, running, last
        end
      end
    end
    if best == nil then
      return {}
    end
    ws = best
  end
  local head = redis.call('ZPOPMIN', P .. 'q:' .. ws)
  if #head == 0 then
    return {}
  end
  local id, i = split(head[1])
  local items = P .. 'i:' .. id
  local attempt = redis.call('HINCRBY', items, 'a:' .. i, 1)
  redis.call('HSET', items, 's:' .. i, '1', 'c:' .. i, now)
  local until_ms = now + lease
  redis.call('ZADD', P .. 'run', until_ms, head[1])
  local batch = P .. 'b:' .. id
  redis.call('HINCRBY', batch, 'queued', -1)
  redis.call('HINCRBY', batch, 'running', 1)
  if redis.call('HGET', batch, 'first') == '0' then
    redis.call('HSET', batch, 'first', now)
  end
  redis.call('HINCRBY', P .. 'wq', ws, -1)
  redis.call('HINCRBY', P .. 'wr', ws, 1)
  redis.call('HSET', P .. 'wl', ws, now)
  local body = redis.call('HGET', items, 'b:' .. i) or ''
  return {id, i, ws, body, attempt, until_ms}

elseif op == 'renew' then
  local m = member(ARGV[2], ARGV[3])
  if not redis.call('ZSCORE', P .. 'run', m) then
    return 0
  end
  redis.call('ZADD', P .. 'run', tonumber(ARGV[4]) + tonumber(ARGV[5]), m)
  return 1

elseif op == 'renew_all' then
  -- now, lease, then (id, index) pairs: one ZADD XX for all of them (XX: an item
  -- no longer running is not added back); returns how many were renewed.
  local until_ms = tonumber(ARGV[2]) + tonumber(ARGV[3])
  local args = {}
  for k = 4, #ARGV - 1, 2 do
    args[#args + 1] = until_ms
    args[#args + 1] = member(ARGV[k], ARGV[k + 1])
  end
  if #args == 0 then
    return 0
  end
  return redis.call('ZADD', P .. 'run', 'XX', 'CH', unpack(args))

elseif op == 'release' then
  -- id, index, attempts: back in the queue with `attempts` spent.
  if not redis.call('ZSCORE', P .. 'run', member(ARGV[2], ARGV[3])) then
    return 0
  end
  local released = requeue(ARGV[2], tonumber(ARGV[3]))
  if released == 1 then
    redis.call('HSET', P .. 'i:' .. ARGV[2], 'a:' .. ARGV[3], ARGV[4])
  end
  return released

elseif op == 'finish' then
  -- id, index, state (2 done, 3 failed), result, now
  local id, i, state, result, now = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], tonumber(ARGV[6])
  local items = P .. 'i:' .. id
  local was = redis.call('HGET', items, 's:' .. i)
  if not was then
    return 2
  end
  if was == '2' or was == '3' then
    return 1
  end
  local batch = P .. 'b:' .. id
  local ws = redis.call('HGET', batch, 'ws')
  local m = member(id, i)
  -- The body goes, the result stays: the bytes held move by the difference.
  local delta = string.len(result) - string.len(redis.call('HGET', items, 'b:' .. i) or '')
  redis.call('HSET', items, 's:' .. i, state, 'r:' .. i, result)
  redis.call('HDEL', items, 'b:' .. i)
  redis.call('HINCRBY', batch, 'bytes', delta)
  redis.call('HINCRBY', P .. 'stats', 'bytes', delta)
  redis.call('HINCRBY', P .. 'stats', 'unfinished', -1)
  local origin = redis.call('HGET', batch, 'origin') or ''
  if origin ~= '' then
    redis.call('HINCRBY', P .. 'ou', origin, -1)
    redis.call('HINCRBY', P .. 'ob', origin, delta)
  end
  if was == '1' then
    redis.call('ZREM', P .. 'run', m)
    redis.call('HINCRBY', batch, 'running', -1)
    redis.call('HINCRBY', P .. 'wr', ws, -1)
    local took = now - num(redis.call('HGET', items, 'c:' .. i))
    if took < 0 then took = 0 end
    local mean = redis.call('HGET', P .. 'stats', 'mean')
    if mean then
      mean = math.floor((tonumber(mean) * 7 + took) / 8)
    else
      mean = took
    end
    redis.call('HSET', P .. 'stats', 'mean', mean)
  else
    redis.call('ZREM', P .. 'q:' .. ws, m)
    redis.call('HINCRBY', batch, 'queued', -1)
    redis.call('HINCRBY', P .. 'wq', ws, -1)
  end
  forget_workspace_if_idle(ws)
  if state == '3' then
    redis.call('HINCRBY', batch, 'failed', 1)
  else
    redis.call('HINCRBY', batch, 'done', 1)
  end
  local left = redis.call('HMGET', batch, 'queued', 'running')
  if num(left[1]) == 0 and num(left[2]) == 0 then
    redis.call('HSET', batch, 'finished', now)
    redis.call('ZADD', P .. 'fin', now, id)
  end
  return 0

elseif op == 'earlier' then
  -- ws, key, digest: the batch the key made, when of the same body.
  local existing = redis.call('HGET', P .. 'keys', keyfield(ARGV[2], ARGV[3]))
  if not existing then
    return {}
  end
  local b = redis.call('HMGET', P .. 'b:' .. existing, 'digest', 'total')
  if b[1] ~= ARGV[4] then
    return {}
  end
  return {existing, num(b[2])}
elseif op == 'status' then
  local ws, id = ARGV[2], ARGV[3]
  local batch = P .. 'b:' .. id
  local b = redis.call('HMGET', batch, 'ws', 'total', 'done', 'failed', 'queued', 'running',
    'created', 'first', 'finished')
  if b[1] ~= ws then
    return {}
  end
  local mean = redis.call('HGET', P .. 'stats', 'mean') or '-1'
  local out = {num(b[2]), num(b[3]), num(b[4]), num(b[5]), num(b[6]), num(b[7]), num(b[8]),
    num(b[9]), tonumber(mean)}
  local items = P .. 'i:' .. id
  for i = 0, num(b[2]) - 1 do
    local f = redis.call('HMGET', items, 's:' .. i, 'a:' .. i, 'r:' .. i)
    table.insert(out, num(f[1]))
    table.insert(out, num(f[2]))
    table.insert(out, f[3] or '')
  end
  return out

elseif op == 'backlogs' then
  local out = {}
  local queued = redis.call('HGETALL', P .. 'wq')
  local seen = {}
  for k = 1, #queued, 2 do
    seen[queued[k]] = true
    table.insert(out, queued[k])
    table.insert(out, num(queued[k + 1]))
    table.insert(out, num(redis.call('HGET', P .. 'wr', queued[k])))
  end
  local running = redis.call('HGETALL', P .. 'wr')
  for k = 1, #running, 2 do
    if not seen[running[k]] then
      table.insert(out, running[k])
      table.insert(out, 0)
      table.insert(out, num(running[k + 1]))
    end
  end
  return out

elseif op == 'maintain' then
  -- now, cutoff (finished at or before it is purged), most batches purged
  local now, cutoff, most = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local requeued = 0
  local expired = redis.call('ZRANGEBYSCORE', P .. 'run', '-inf', now)
  for _, m in ipairs(expired) do
    local id, i = split(m)
    requeued = requeued + requeue(id, i)
    redis.call('ZREM', P .. 'run', m)
  end
  local old = redis.call('ZRANGEBYSCORE', P .. 'fin', '-inf', cutoff, 'LIMIT', 0, most)
  local freed = 0
  for _, id in ipairs(old) do
    local batch = P .. 'b:' .. id
    local b = redis.call('HMGET', batch, 'ws', 'hk', 'key', 'total', 'origin', 'bytes')
    if b[2] == '1' then
      local field = keyfield(b[1], b[3])
      if redis.call('HGET', P .. 'keys', field) == id then
        redis.call('HDEL', P .. 'keys', field)
      end
    end
    freed = freed + num(b[4])
    redis.call('HINCRBY', P .. 'stats', 'bytes', -num(b[6]))
    local origin = b[5] or ''
    if origin ~= '' then
      local left = redis.call('HINCRBY', P .. 'ob', origin, -num(b[6]))
      if left <= 0 and num(redis.call('HGET', P .. 'ou', origin)) <= 0 then
        redis.call('HDEL', P .. 'ob', origin)
        redis.call('HDEL', P .. 'ou', origin)
      end
    end
    redis.call('DEL', batch, P .. 'i:' .. id)
    redis.call('ZREM', P .. 'fin', id)
  end
  if freed > 0 then
    redis.call('HINCRBY', P .. 'stats', 'stored', -freed)
  end
  return {requeued, #old}
end

return redis.error_reply('unknown batch operation ' .. tostring(op))
