-- fenced-redis: who holds the key, read in one atomic step.
--
-- KEYS[1]  lock hash
--
-- Returns {0} free, or {1, owner, token, count, pttl}.
local held = redis.call('HMGET', KEYS[1], 'owner', 'token', 'count')
if not held[1] then
  return {0}
end
return {1, held[1], held[2], tonumber(held[3]) or 1, redis.call('PTTL', KEYS[1])}
