-- sluice: one decision over every budget of a request, atomically, on the
-- Redis server's clock (never a replica's). Mirrors sluice-core's algorithms
-- at the server clock's resolution, the microsecond: at any instant in whole
-- microseconds both decide alike (tests/parity.rs holds them to it).
--
-- One call may carry several requests (concurrent decisions coalesced by the
-- client); they are decided in order, each all or nothing, and a later one
-- sees what an earlier one spent — as if they had come one by one.
--
-- KEYS     each key the call touches, once: one hash per budget, fields w (window
--          id), c (count), p (previous count), t (GCRA TAT, us); for a rolling
--          window, one field per slot holding units: slot number -> count
-- ARGV[1]  'spend' | 'peek' | 'adjust' | 'adjusts' (each budget by the delta in its cost)
-- ARGV[2]  for 'adjust': delta, ARGV[3] reserved_at (Unix microseconds); otherwise unused
-- ARGV[4]  the time to decide at (Unix microseconds), sent only by a store built
--          with an injected clock (tests); 0: the server's TIME
-- ARGV[5]  the number of distinct budgets; then per budget: its key's index in
--          KEYS, kind (f fixed, l a fixed window leased, s sliding, m month, g
--          gcra, r rolling, u a run's turns), limit, cost, window seconds (f, l,
--          s), period in microseconds (g), window milliseconds (r) or idle
--          seconds (u), burst (g), slot milliseconds (r) or the units a lease
--          wants (l: 'spend' takes at least the cost and up to that many, as
--          many as are left, as sluice-core's take_lease; otherwise as f);
--          kind b, a lease's leftover given back ('spend' only): its units as
--          the cost, the second the lease was taken in as the burst, given back
--          as 'adjust' by minus the units at that second (a window already
--          over takes nothing back); always admitted
-- then     the number of entries; per entry: how many identical requests in a
--          row it stands for, its number of budgets n, then n budget indices
-- Returns {now_s, now_us_fraction, then per budget of every request: verdict
--          (0 admitted, 1 not yet, 2 never), remaining after spending, remaining
--          before, reset (Unix s), retry_after (us)}. A request writes only when
--          all its budgets admit ('spend'), or always ('adjust').

local mode = ARGV[1]
-- 'adjusts': an adjustment of each budget by its own delta, carried in its cost
-- offset by 2^31.
local each = mode == 'adjusts'
if each then mode = 'adjust' end
local now_s, now_frac
local injected = tonumber(ARGV[4]) or 0
if injected > 0 then
  now_s = math.floor(injected / 1000000)
  now_frac = injected - now_s * 1000000
else
  local t = redis.call('TIME')
  now_s, now_frac = tonumber(t[1]), tonumber(t[2])
end
local now_us = now_s * 1000000 + now_frac
local delta = tonumber(ARGV[2]) or 0
local reserved_us = tonumber(ARGV[3]) or now_us
local reserved = math.floor(reserved_us / 1000000)

-- Integers are doubles here: exact below 2^53. A quotient is rounded, so
-- its floor is corrected by one where the rounding crossed an integer.
local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function ceil_div(a, b) return -floor_div(-a, b) end

-- Howard Hinnant's civil-date algorithms, as in sluice-core's calendar.rs.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor_div(y, 400)
  local yoe = y - era * 400
  local mp = (m > 2) and (m - 3) or (m + 9)
  local doy = floor_div(153 * mp + 2, 5) + d - 1
  local doe = yoe * 365 + floor_div(yoe, 4) - floor_div(yoe, 100) + doy
  return era * 146097 + doe - 719468
end
local function civil_from_days(z)
  z = z + 719468
  local era = floor_div(z, 146097)
  local doe = z - era * 146097
  local yoe = floor_div(doe - floor_div(doe, 1460) + floor_div(doe, 36524) - floor_div(doe, 146096), 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + floor_div(yoe, 4) - floor_div(yoe, 100))
  local mp = floor_div(5 * doy + 2, 153)
  local m = (mp < 10) and (mp + 3) or (mp - 9)
  if m <= 2 then y = y + 1 end
  return y, m
end
local function month_bounds(s)
  local y, m = civil_from_days(floor_div(s, 86400))
  local start = days_from_civil(y, m, 1) * 86400
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return start, days_from_civil(ny, nm, 1) * 86400
end

-- Committed state per key (what earlier requests of this call spent).
local state = {}
local function load(key)
  if state[key] == nil then
    local h = redis.call('HMGET', key, 'w', 'c', 'p', 't')
    local w, c, p, tat = tonumber(h[1]) or -1, tonumber(h[2]) or 0, tonumber(h[3]) or 0, tonumber(h[4]) or 0
    -- w0 … t0: what is stored, so that only changed fields are written.
    state[key] = { w = w, c = c, p = p, t = tat, w0 = w, c0 = c, p0 = p, t0 = tat,
                   dirty = false, expire = 0 }
  end
  return state[key]
end
-- A rolling window's slots: r (slot -> count), r0 (what is stored).
local function load_slots(key)
  if state[key] == nil then
    local h = redis.call('HGETALL', key)
    local r, r0 = {}, {}
    for i = 1, #h, 2 do
      local j, c = tonumber(h[i]), tonumber(h[i + 1])
      if j and c then r[j] = c; r0[j] = c end
    end
    state[key] = { rolling = true, r = r, r0 = r0, dirty = false, expire = 0, moved = false }
  end
  return state[key]
end
local function copy_slots(s)
  local r = {}
  for j, c in pairs(s.r) do r[j] = c end
  return { rolling = true, r = r, r0 = s.r0, dirty = s.dirty, expire = s.expire, moved = s.moved }
end
-- The counted slots of a rolling window (first..current, holding units),
-- oldest first, and the units they hold.
local function counted(r, first, current)
  local js, used = {}, 0
  for j, c in pairs(r) do
    if j >= first and j <= current and c > 0 then js[#js + 1] = j; used = used + c end
  end
  table.sort(js)
  return js, used
end

-- The distinct budgets, read once.
local b_key, b_kind, b_limit, b_cost, b_w, b_burst = {}, {}, {}, {}, {}, {}
local argi = 6
for i = 1, tonumber(ARGV[5]) do
  b_key[i] = KEYS[tonumber(ARGV[argi])]
  b_kind[i] = ARGV[argi + 1]
  b_limit[i], b_cost[i] = tonumber(ARGV[argi + 2]), tonumber(ARGV[argi + 3])
  b_w[i], b_burst[i] = tonumber(ARGV[argi + 4]), tonumber(ARGV[argi + 5])
  argi = argi + 6
end

-- What a request changed, to undo when it does not commit: per change the
-- key and either the fields before it (w, c, p, t, dirty, expire) or, for a
-- rolling window, a copy of its state before it.
local u_key, u_w, u_c, u_p, u_t, u_dirty, u_expire, u_slots = {}, {}, {}, {}, {}, {}, {}, {}
local undo_n = 0
local function save(key, s)
  undo_n = undo_n + 1
  u_key[undo_n] = key
  if s.rolling then
    u_slots[undo_n] = copy_slots(s)
  else
    u_slots[undo_n] = false
    u_w[undo_n], u_c[undo_n], u_p[undo_n], u_t[undo_n] = s.w, s.c, s.p, s.t
    u_dirty[undo_n], u_expire[undo_n] = s.dirty, s.expire
  end
end
local function undo()
  for i = undo_n, 1, -1 do
    local key = u_key[i]
    if u_slots[i] then
      state[key] = u_slots[i]
    else
      local s = state[key]
      s.w, s.c, s.p, s.t, s.dirty, s.expire = u_w[i], u_c[i], u_p[i], u_t[i], u_dirty[i], u_expire[i]
    end
  end
  undo_n = 0
end

local out = { now_s, now_frac }
local entries = tonumber(ARGV[argi])
argi = argi + 1
for _ = 1, entries do
local times, n = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1])
local first = argi + 2
argi = first + n
-- One budget alone commits or changes nothing by itself when spending;
-- otherwise each change is recorded, to be undone unless the request commits.
local track = mode == 'peek' or (mode == 'spend' and n > 1)
for _ = 1, times do
local all_ok = true
undo_n = 0
for i = 0, n - 1 do
  local bi = tonumber(ARGV[first + i])
  local key, kind, limit, cost = b_key[bi], b_kind[bi], b_limit[bi], b_cost[bi]
  if each then delta = cost - 2147483648; cost = 0 end
  local w, burst = b_w[bi], b_burst[bi]
  local s
  if kind == 'r' then s = load_slots(key) else s = load(key) end
  if track then save(key, s) end
  local never = cost > limit
  local verdict, before, after, reset, retry = 0, 0, 0, 0, 0
  if kind == 'f' or kind == 'm' or kind == 'l' then
    local start, stop
    if kind ~= 'm' then start = floor_div(now_s, w) * w; stop = start + w
    else start, stop = month_bounds(now_s) end
    local c = (s.w == start) and math.min(s.c, limit) or 0
    if mode == 'adjust' then
      -- Counted past the limit too (a settlement can take a budget below zero
      -- for the rest of its window): a later refund takes back from the count.
      local raw = (s.w == start) and s.c or 0
      local rstart = (kind ~= 'm') and (floor_div(reserved, w) * w) or month_bounds(reserved)
      local nc = raw
      if not (delta < 0 and rstart ~= start) then nc = math.max(0, math.min(4294967295, raw + delta)) end
      if nc ~= raw then s.w, s.c, s.dirty, s.expire = start, nc, true, stop + 1 end
      before, after = math.max(0, limit - raw), math.max(0, limit - nc)
    else
      local fits = (not never) and (c + cost <= limit)
      before = limit - c
      local take = cost
      if kind == 'l' and fits and mode == 'spend' then take = math.max(cost, math.min(burst, before)) end
      after = fits and (before - take) or before
      if never then verdict = 2 elseif not fits then verdict = 1; retry = stop * 1000000 - now_us end
      if fits and take > 0 then s.w, s.c, s.dirty, s.expire = start, c + take, true, stop + 1 end
    end
    reset = stop
  elseif kind == 'b' then
    local start = floor_div(now_s, w) * w
    local stop = start + w
    local c = (s.w == start) and math.min(s.c, limit) or 0
    local nc = c
    if mode == 'spend' and floor_div(burst, w) * w == start then nc = math.max(0, c - cost) end
    if nc ~= c then s.w, s.c, s.dirty, s.expire = start, nc, true, stop + 1 end
    before, after, reset = limit - c, limit - nc, stop
  elseif kind == 's' then
    local idx = floor_div(now_s, w)
    local start, stop = idx * w, idx * w + w
    local cur, prev = 0, 0
    if s.w == idx then cur, prev = s.c, s.p elseif s.w == idx - 1 then prev = s.c end
    -- In microseconds, as sluice-core weighs (exact while limit x w < 4.5e9).
    local wm = w * 1000000
    local elapsed = now_us - start * 1000000
    local used = prev * (wm - elapsed) + cur * wm
    local cap = limit * wm
    if mode == 'adjust' then
      if delta >= 0 or floor_div(reserved, w) == idx then
        local room = math.max(cur, floor_div(cap - prev * (wm - elapsed), wm))
        local nc = math.max(0, math.min(limit, room, cur + delta))
        if delta < 0 then nc = math.max(0, cur + delta) end
        if nc ~= cur then s.w, s.c, s.p, s.dirty, s.expire = idx, nc, prev, true, stop + w + 1 end
        cur = nc
      elseif floor_div(reserved, w) == idx - 1 then
        local np = math.max(0, prev + delta)
        if np ~= prev then s.w, s.c, s.p, s.dirty, s.expire = idx, cur, np, true, stop + w + 1 end
        prev = np
      end
      used = prev * (wm - elapsed) + cur * wm
      before = math.max(0, floor_div(cap - used, wm))
      after = before
    else
      local need = cost * wm
      local fits = (not never) and (used + need <= cap)
      before = math.max(0, floor_div(cap - used, wm))
      after = fits and floor_div(cap - used - need, wm) or before
      if never then verdict = 2
      elseif not fits then
        verdict = 1
        if cur + cost <= limit then
          local room = (limit - cur - cost) * wm
          local e_needed = math.max(0, wm - floor_div(room, math.max(prev, 1)))
          retry = math.max(0, e_needed - elapsed)
        else
          local room = (limit - cost) * wm
          local e_needed = wm - math.min(wm, floor_div(room, math.max(cur, 1)))
          retry = (wm - elapsed) + e_needed
        end
      end
      if fits and cost > 0 then s.w, s.c, s.p, s.dirty, s.expire = idx, cur + cost, prev, true, stop + w + 1 end
    end
    reset = stop
  elseif kind == 'r' then
    -- Rolling: w = window ms, burst = slot ms, widened to at most 4096
    -- slots per window (sluice-core's MAX_ROLLING_SLOTS). A unit counts
    -- until its slot's end + the window.
    local slot = math.max(burst, ceil_div(w, 4096)) * 1000
    local span = w * 1000
    local current = floor_div(now_us, slot)
    local first = floor_div(math.max(0, now_us - span), slot)
    local js, used = counted(s.r, first, current)
    local target, add = nil, 0
    before = math.max(0, limit - used)
    if mode == 'adjust' then
      if delta < 0 then
        local jr = floor_div(reserved_us, slot)
        if jr >= first and jr <= current then target = jr end
      else
        target = current
      end
      if target then
        local old = s.r[target] or 0
        if delta < 0 then add = math.max(0, old + delta) - old
        else add = math.min(delta, before) end
      end
      after = math.max(0, limit - used - add)
    else
      local fits = (not never) and (used + cost <= limit)
      after = fits and (before - cost) or before
      if never then verdict = 2
      elseif not fits then
        verdict = 1
        local left, at = used, now_us
        for _, j in ipairs(js) do
          left = left - s.r[j]
          if left <= limit - cost then at = (j + 1) * slot + span; break end
        end
        retry = at - now_us
      end
      if fits and cost > 0 then target, add = current, cost end
    end
    if add ~= 0 then
      s.r[target] = (s.r[target] or 0) + add
      for j in pairs(s.r) do
        if j < first then s.r[j] = nil end
      end
      s.dirty = true
      if target == current then
        s.moved, s.expire = true, ceil_div((current + 1) * slot + span, 1000000) + 1
      end
      js = counted(s.r, first, current)
    end
    if #js > 0 then reset = ceil_div((js[#js] + 1) * slot + span, 1000000)
    else reset = ceil_div(now_us, 1000000) end
  elseif kind == 'u' then
    -- A run's turns (sluice-core's Rate::Turns), w = seconds it is remembered
    -- after its last change: fields w (until, Unix s), c (net turns: taken less
    -- granted; past p: finished), p (its tier's turns, kept from its first).
    -- The key's own expiry (field t) moves only when the run outlives it, by
    -- a sixteenth of w at a time: a key may outlive its run by that much (it
    -- then reads as a new run), and a busy run re-expires rarely.
    local known = s.w >= now_s
    local turns = known and s.p or math.min(math.max(limit, 1), 10000)
    local net = known and s.c or 0
    local until_s = known and s.w or now_s
    local function keep(nn)
      until_s = now_s + w
      s.w, s.c, s.p, s.dirty, s.turns = until_s, nn, turns, true, true
      if s.t <= until_s then s.t = until_s + 1 + math.max(1, floor_div(w, 16)) end
      s.expire = s.t
    end
    before = math.max(0, turns - net)
    if mode == 'adjust' then
      local nn = math.max(-50000, math.min(turns + 1, net + delta))
      -- Kept whenever adjusted, by 0 too: the owner acting on a run keeps it.
      keep(nn)
      after = math.max(0, turns - nn)
    else
      local finished = net > turns
      local fits = (not finished) and (net + cost <= turns)
      after = fits and (before - cost) or before
      if fits and cost > 0 then keep(net + cost) end
      if finished then verdict = 2
      elseif not fits then verdict = 1; retry = (until_s - now_s) * 1000000 end
    end
    reset = until_s
  else -- 'g': GCRA, w = period in us
    local T = math.max(1, floor_div(w, math.max(limit, 1)))
    local capacity = T * burst
    local tat = math.max(s.t, now_us)
    local debt = tat - now_us
    never = never or cost > burst
    if mode == 'adjust' then
      local nt = tat + T * delta
      nt = math.max(now_us, math.min(now_us + capacity, nt))
      if nt ~= tat then s.t, s.dirty, s.expire = nt, true, floor_div(nt, 1000000) + 2 end
      before = floor_div(math.max(0, capacity - debt), T)
      after = floor_div(math.max(0, capacity - (nt - now_us)), T)
      tat = nt
      reset = math.ceil(nt / 1000000)
    else
      local spend = T * cost
      local fits = (not never) and (debt + spend <= capacity)
      before = floor_div(math.max(0, capacity - debt), T)
      after = fits and floor_div(capacity - debt - spend, T) or before
      if never then verdict = 2 elseif not fits then verdict = 1; retry = debt + spend - capacity end
      local drained = tat
      if fits and cost > 0 then
        s.t, s.dirty, s.expire = tat + spend, true, floor_div(tat + spend, 1000000) + 2
        drained = tat + spend
      end
      reset = math.ceil(drained / 1000000)
    end
  end
  if verdict ~= 0 then all_ok = false end
  out[#out + 1] = verdict
  out[#out + 1] = after
  out[#out + 1] = before
  out[#out + 1] = reset
  out[#out + 1] = retry
end
if track and not (mode == 'spend' and all_ok) then undo() end
end
end

-- Write what changed; the expiry only moves with a new window (or a new TAT).
for key, s in pairs(state) do
  if s.dirty and s.rolling then
    local fields, gone = {}, {}
    for j, c in pairs(s.r) do
      if c ~= s.r0[j] then fields[#fields + 1] = string.format('%d', j); fields[#fields + 1] = c end
    end
    for j in pairs(s.r0) do
      if s.r[j] == nil then gone[#gone + 1] = string.format('%d', j) end
    end
    if #fields > 0 then redis.call('HSET', key, unpack(fields)) end
    if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
    if s.moved then redis.call('EXPIREAT', key, s.expire) end
  elseif s.dirty then
    local fields = {}
    if s.w ~= s.w0 then fields[#fields + 1] = 'w'; fields[#fields + 1] = s.w end
    if s.c ~= s.c0 then fields[#fields + 1] = 'c'; fields[#fields + 1] = s.c end
    if s.p ~= s.p0 then fields[#fields + 1] = 'p'; fields[#fields + 1] = s.p end
    if s.t ~= s.t0 then fields[#fields + 1] = 't'; fields[#fields + 1] = s.t end
    if #fields > 0 then redis.call('HSET', key, unpack(fields)) end
    if s.turns then
      if s.t ~= s.t0 then redis.call('EXPIREAT', key, s.expire) end
    elseif s.w ~= s.w0 or s.t ~= s.t0 then
      redis.call('EXPIREAT', key, s.expire)
    end
  end
end
return out
