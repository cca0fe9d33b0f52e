-- fenced-redis: a waiter gives up (timeout or cancelled future). If the key is
-- free, the wake-up it may have been sent passes to the next live waiter.
--
-- KEYS[1]  lock hash
-- KEYS[2]  waiter queue
-- ARGV[1]  release channel
-- ARGV[2]  waiter id
--
-- Returns 1.
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  local next_waiter = redis.call('ZRANGE', KEYS[2], 0, 0)
  if next_waiter[1] then
    redis.call('PUBLISH', ARGV[1], next_waiter[1])
  end
end
return 1
