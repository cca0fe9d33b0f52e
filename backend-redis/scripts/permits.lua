-- Semaphores and reader-writer locks: the line model of fenced_api::permits
-- in one hash per key, KEYS[1] = `{prefix/key}:p`:
--   n        the key's last token (kept for ever, so tokens only grow)
--   c        the capacity its live entries agreed on (absent when none)
--   t<token> an entry, holder or waiter: cjson {o owner, w weight,
--            x expiry (server ms), c hold count, l label}
-- An entry is granted once the weights of the live entries up to it (in
-- token order) fit the capacity. Times come from the server's clock.
-- Tokens are max(last token + 1, server time in µs), as for the mutexes
-- (prelude.lua): the last token keeps them rising while Redis keeps the
-- hash, the clock when Redis lost it (a restart without persistence).
-- ARGV[1] is the operation; the rest depend on it (see below).

local key = KEYS[1]
local op = ARGV[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local MAX_TOKEN = 9007199254740992

-- Tokens are 16-digit numbers: always written with %.0f (Lua's own
-- conversion keeps 14 digits).
local function field(t)
  return 't' .. string.format('%.0f', t)
end

local function save(e)
  redis.call('HSET', key, field(e.t), cjson.encode({o = e.o, w = e.w, x = e.x, c = e.c, l = e.l}))
end

-- The live entries in token order (expired ones deleted), the capacity,
-- the last token.
local function line()
  local flat = redis.call('HGETALL', key)
  local entries, cap, last = {}, nil, 0
  for i = 1, #flat, 2 do
    local f, v = flat[i], flat[i + 1]
    if f == 'c' then
      cap = tonumber(v)
    elseif f == 'n' then
      last = tonumber(v)
    else
      local e = cjson.decode(v)
      e.t = tonumber(string.sub(f, 2))
      if e.x > now then
        entries[#entries + 1] = e
      else
        redis.call('HDEL', key, f)
      end
    end
  end
  table.sort(entries, function(a, b) return a.t < b.t end)
  if #entries == 0 and cap then
    redis.call('HDEL', key, 'c')
    cap = nil
  end
  return entries, cap, last
end

local function granted(entries, cap)
  local sum, n = 0, 0
  for _, e in ipairs(entries) do
    sum = sum + e.w
    if sum > cap then break end
    n = n + 1
  end
  return n
end

-- The index of `owner`'s entry `token`, or nil.
local function find(entries, owner, token)
  for i, e in ipairs(entries) do
    if e.t == token and e.o == owner then return i end
  end
  return nil
end

if op == 'arrive' then
  -- owner, capacity, weight, ttl ms, label, reentrant (1/0), queue (1/0)
  local owner, capacity, weight = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local ttl, label = tonumber(ARGV[5]), ARGV[6]
  local entries, cap, last = line()
  if cap and cap ~= capacity then return {'mismatch', cap} end
  cap = capacity
  local g = granted(entries, cap)
  local total, mine = 0, nil
  for i, e in ipairs(entries) do
    total = total + e.w
    if e.o == owner then mine = i end
  end
  if mine then
    local e = entries[mine]
    if ARGV[7] == '1' and mine <= g and e.w == weight then
      e.c = e.c + 1
      e.x = math.max(e.x, now + ttl)
      save(e)
      return {'granted', e.t}
    end
    return {'held'}
  end
  local fits = total + weight <= cap
  if not fits and ARGV[8] ~= '1' then return {'busy'} end
  if now_us > last then
    last = now_us
  elseif last + 1 >= MAX_TOKEN then
    return redis.error_reply('fenced: the fencing token of ' .. key .. ' would exceed 2^53')
  else
    last = last + 1
  end
  redis.call('HSET', key, 'n', string.format('%.0f', last), 'c', cap)
  save({t = last, o = owner, w = weight, x = now + ttl, c = 1, l = label})
  if fits then return {'granted', last} end
  return {'queued', last}
elseif op == 'look' then
  -- owner, token, ttl ms, renew (1/0)
  local owner, token, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local entries, cap = line()
  local i = find(entries, owner, token)
  if not i then return {'gone'} end
  local e = entries[i]
  if i <= granted(entries, cap) then
    e.x = now + ttl
    save(e)
    return {'granted'}
  end
  if ARGV[5] == '1' then
    e.x = now + ttl
    save(e)
  end
  return {'waiting'}
elseif op == 'leave' then
  -- owner, token
  local entries = line()
  local i = find(entries, ARGV[2], tonumber(ARGV[3]))
  if not i then return 0 end
  redis.call('HDEL', key, field(entries[i].t))
  if #entries == 1 then redis.call('HDEL', key, 'c') end
  return 1
elseif op == 'extend' then
  -- owner, token, ttl ms
  local ttl = tonumber(ARGV[4])
  local entries, cap = line()
  local i = find(entries, ARGV[2], tonumber(ARGV[3]))
  if not i or i > granted(entries, cap) then return 0 end
  local e = entries[i]
  if e.c > 1 then e.x = math.max(e.x, now + ttl) else e.x = now + ttl end
  save(e)
  return 1
elseif op == 'release' then
  -- owner, token: {0} not held, {1} released, {2, left} still held
  local entries, cap = line()
  local i = find(entries, ARGV[2], tonumber(ARGV[3]))
  if not i or i > granted(entries, cap) then return {0} end
  local e = entries[i]
  if e.c > 1 then
    e.c = e.c - 1
    save(e)
    return {2, e.c}
  end
  redis.call('HDEL', key, field(e.t))
  if #entries == 1 then redis.call('HDEL', key, 'c') end
  return {1}
elseif op == 'line' then
  -- {capacity, then per live entry in line order: owner, token, remaining
  -- ms, count, label, weight}; {} for an empty line
  local entries, cap = line()
  if #entries == 0 then return {} end
  local out = {cap}
  for _, e in ipairs(entries) do
    for _, v in ipairs({e.o, e.t, e.x - now, e.c, e.l, e.w}) do out[#out + 1] = v end
  end
  return out
elseif op == 'force' then
  -- 1 when a live holder was removed; the last token stays
  local entries, cap = line()
  for _, e in ipairs(entries) do redis.call('HDEL', key, field(e.t)) end
  redis.call('HDEL', key, 'c')
  if #entries > 0 then return 1 end
  return 0
end
return redis.error_reply('unknown permits operation ' .. tostring(op))
