-- fenced-redis: push a current lease's expiry to ttl from now. Never creates a lock.
--
-- KEYS[1]  lock hash
-- ARGV[1]  owner
-- ARGV[2]  token (decimal string, as granted)
-- ARGV[3]  ttl in ms
--
-- Returns 1 extended, 0 the lease is not current (expired, released, or another holder).
local held = redis.call('HMGET', KEYS[1], 'owner', 'token', 'count')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then
  return 0
end
local ttl = tonumber(ARGV[3])
if (tonumber(held[3]) or 1) > 1 then
  -- Re-entered: never cut the expiry another entry relies on.
  if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
else
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
