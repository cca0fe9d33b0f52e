-- fenced-redis: administrative release, whoever holds the key; wakes the next live waiter.
--
-- KEYS[1]  lock hash
-- KEYS[2]  waiter queue
-- ARGV[1]  release channel
--
-- Returns 1 if a current lock was removed, else 0.
local removed = redis.call('DEL', KEYS[1])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
local next_waiter = redis.call('ZRANGE', KEYS[2], 0, 0)
if next_waiter[1] then
  redis.call('PUBLISH', ARGV[1], next_waiter[1])
end
return removed
