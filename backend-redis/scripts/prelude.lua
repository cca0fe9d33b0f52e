-- fenced-redis: shared by every script (the crate puts it in front of each).
--
-- KEYS[1]  state  {prefix/key}:l  a string, kept RETAIN ms after its last write:
--            token|count|expiry|queued|waiter|holder
--          token   the last fencing token granted for the key; kept while the
--                  key is free, so it is also the fence
--          count   hold count (re-entries); 0 = free
--          expiry  end of the lease in server ms: a lease is current while
--                  count > 0 and expiry > now
--          queued  1 if the queue may hold entries, 0 if it is known empty
--          waiter  id of the queued waiter the lease was handed to, until it
--                  claims it (a queued attempt finding it, or a renewal),
--                  or empty
--          holder  the holder's owner, then a newline and its label when it
--                  gave one (last: both may contain '|'; neither contains a
--                  control character, so the newline is unambiguous, and a
--                  holder without a newline reads as unlabelled)
-- KEYS[2]  queue  {prefix/key}:q  zset of waiters in arrival order, kept
--          RETAIN ms after it was started or a waiter last refreshed:
--            member deadline|ttl|waiter id|wake-up channel|holder
--          the channel is a whole channel name (`{prefix/}:w:<client>`, one
--          server: PUBLISH), or `:w:<client>` for the channel of that name
--          after this key's hash tag (a Cluster client: SPUBLISH, which a
--          script may only do in its keys' slot; the key itself may hold '|',
--          so the entry names only the suffix)
--            score  arrival time in server µs (kept when a waiter refreshes)
--          deadline is the entry's liveness deadline in server ms; dead
--          entries are dropped when the key passes on.
--
-- Tokens are max(last token + 1, server time in µs): the last token keeps
-- them rising while Redis keeps the state (clock steps back included), the
-- clock keeps them rising when Redis lost it (restart without persistence).
-- Both stay below 2^53, where Lua numbers are exact.
local S, Q = KEYS[1], KEYS[2]
local RETAIN = 604800000
local MAX_TOKEN = 9007199254740992
-- Dead entries dropped by one script at most (bounds its run time).
local MAX_POPS = 64

-- Server time: ms and µs as numbers, µs also as a decimal string (cheaper
-- than formatting a 16-digit number).
local function clock()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us, t[1] .. string.sub('00000' .. t[2], -6)
end

-- A holder field (see above) as owner and label ('' for none).
local function split_holder(h)
  local own, lab = string.match(h, '^([^\n]*)\n(.*)$')
  if own then
    return own, lab
  end
  return h, ''
end

local function holder(own, lab)
  if lab and lab ~= '' then
    return own .. '\n' .. lab
  end
  return own
end

-- The state; the token stays a decimal string (it is only ever compared and
-- copied), the other numbers are below 10^14, where Lua prints them exactly.
local function load()
  local v = redis.call('GET', S)
  if not v then
    return '0', 0, 0, 0, '', '', ''
  end
  local tok, cnt, exp, q, wid, h = string.match(v, '^(%d+)|(%d+)|(%d+)|([01])|(%x*)|(.*)$')
  if not tok then
    error({err = 'fenced: unexpected value under ' .. S})
  end
  local own, lab = split_holder(h)
  return tok, tonumber(cnt), tonumber(exp), tonumber(q), wid, own, lab
end

-- `lab` may be left out (free states, which have no holder).
local function save(tok, cnt, exp, q, wid, own, lab)
  redis.call('SET', S, tok .. '|' .. cnt .. '|' .. exp .. '|' .. q .. '|' .. wid .. '|' ..
    holder(own, lab), 'PX', RETAIN)
end

-- The next token as a decimal string.
local function next_token(last, now_us, now_us_s)
  last = tonumber(last)
  if now_us > last then
    return now_us_s
  end
  if last + 1 >= MAX_TOKEN then
    error({err = 'fenced: the fencing token of ' .. S .. ' would exceed 2^53'})
  end
  return string.format('%.0f', last + 1)
end

-- The key is free: hand it to the first live waiter in arrival order. An
-- entry is live while its deadline has not passed and a connection listens
-- on its channel (PUBLISH and SPUBLISH count the receivers); others are
-- dropped.
-- Returns 'other', ttl   handed over: state saved, waiter told
--         'self'         `self` (the caller's own entry) came first; popped
--         'empty'        no live waiter; the queue is empty now
--         'more'         MAX_POPS dead entries dropped, more remain
local function hand_over(tok, now_ms, now_us, now_us_s, self)
  for _ = 1, MAX_POPS do
    local m = redis.call('ZPOPMIN', Q)[1]
    if not m then
      return 'empty'
    end
    if m == self then
      return 'self'
    end
    local dl, ttl, id, ch, h = string.match(m, '^(%d+)|(%d+)|(%x+)|([^|]+)|(.+)$')
    if dl and tonumber(dl) > now_ms then
      local t = next_token(tok, now_us, now_us_s)
      local msg = 'g|' .. t .. '|' .. id .. '|' .. S
      local heard
      if string.sub(ch, 1, 1) == ':' then
        heard = redis.call('SPUBLISH', string.sub(S, 1, -3) .. ch, msg)
      else
        heard = redis.call('PUBLISH', ch, msg)
      end
      if heard > 0 then
        ttl = tonumber(ttl)
        local own, lab = split_holder(h)
        save(t, 1, now_ms + ttl, 1, id, own, lab)
        return 'other', ttl
      end
    end
  end
  return 'more'
end

-- A lease ended (released, left unclaimed, force-released): the next live
-- waiter gets the key, or it is marked free (keeping the last token).
local function pass_on(tok, now_ms, now_us, now_us_s, q)
  if q == 1 then
    local r = hand_over(tok, now_ms, now_us, now_us_s, '')
    if r == 'other' then
      return
    end
    if r == 'more' then
      save(tok, 0, 0, 1, '', '')
      return
    end
  end
  save(tok, 0, 0, 0, '', '')
end

