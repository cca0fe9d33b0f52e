-- fenced-redis: give a lease back and wake the next live waiter.
--
-- KEYS[1]  lock hash
-- KEYS[2]  waiter queue
-- ARGV[1]  release channel
-- ARGV[2]  owner
-- ARGV[3]  token
--
-- Returns {2} released, {1, remaining} re-entered and still held, {0} not current.
local held = redis.call('HMGET', KEYS[1], 'owner', 'token', 'count')
if held[1] ~= ARGV[2] or held[2] ~= ARGV[3] then
  return {0}
end
if (tonumber(held[3]) or 1) > 1 then
  return {1, redis.call('HINCRBY', KEYS[1], 'count', -1)}
end
redis.call('DEL', KEYS[1])

-- Wake one waiter, not all of them: drop waiters whose liveness lease ran
-- out, then name the one that has waited longest since it last checked.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
local next_waiter = redis.call('ZRANGE', KEYS[2], 0, 0)
if next_waiter[1] then
  redis.call('PUBLISH', ARGV[1], next_waiter[1])
end
return {2}
