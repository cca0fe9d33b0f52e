-- fenced-redis: take a lock, re-enter it, or queue for it. One atomic step.
--
-- KEYS[1]  lock hash   {prefix/key}:l   fields owner, token, count; PX = the lease
-- KEYS[2]  fence       {prefix/key}:f   the last token granted for this key
-- KEYS[3]  queue       {prefix/key}:q   waiters, zset member = waiter id, score = liveness deadline (ms)
-- ARGV[1]  owner
-- ARGV[2]  ttl in ms (validated by the client: 10 ms .. 24 h)
-- ARGV[3]  "1" if the owner may re-enter
-- ARGV[4]  waiter id, or "" for a plain try (nothing is queued)
-- ARGV[5]  waiter liveness lease in ms
-- ARGV[6]  fence retention in ms
--
-- Returns {1, token, count}  granted (token as a decimal string)
--         {0, pttl}          held by someone else; pttl = its remaining ms
--         {-1}               held by this owner, who may not re-enter
--
-- Tokens: max(last token + 1, server time in microseconds). The server's
-- clock makes tokens keep rising even when Redis lost the fence key (restart
-- without persistence); the stored last token keeps them rising when the
-- clock steps back. Both stay below 2^53, where Lua numbers are exact.
local lock, fence, queue = KEYS[1], KEYS[2], KEYS[3]
local owner, ttl, waiter = ARGV[1], tonumber(ARGV[2]), ARGV[4]

local held = redis.call('HMGET', lock, 'owner', 'token', 'count')
if held[1] then
  if held[1] == owner then
    if ARGV[3] ~= '1' then
      return {-1}
    end
    local count = redis.call('HINCRBY', lock, 'count', 1)
    -- Never cut the expiry another entry of this owner relies on.
    if redis.call('PTTL', lock) < ttl then
      redis.call('PEXPIRE', lock, ttl)
    end
    return {1, held[2], count}
  end
  if waiter ~= '' then
    local lease = tonumber(ARGV[5])
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('ZADD', queue, now_ms + lease, waiter)
    redis.call('PEXPIRE', queue, lease * 2)
  end
  return {0, redis.call('PTTL', lock)}
end

local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', fence) or '0') or 0
local token = math.max(last + 1, now_us)
if token >= 9007199254740992 then
  return redis.error_reply('fenced: fencing token for ' .. lock .. ' would exceed 2^53')
end
local token_s = string.format('%.0f', token)
redis.call('SET', fence, token_s, 'PX', ARGV[6])
redis.call('HSET', lock, 'owner', owner, 'token', token_s, 'count', 1)
redis.call('PEXPIRE', lock, ttl)
if waiter ~= '' then
  redis.call('ZREM', queue, waiter)
end
return {1, token_s, 1}
