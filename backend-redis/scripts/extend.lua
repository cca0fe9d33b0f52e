-- fenced-redis: push a current lease's expiry to ttl from now. Never creates a lock.
--
-- ARGV[1]  owner
-- ARGV[2]  token (decimal, as granted)
-- ARGV[3]  ttl in ms
--
-- Returns 1 extended, 0 the lease is not current (expired, released, or another holder).
local tok, cnt, exp, q, hwid, hown, hlab = load()
local now_ms = clock()
if cnt == 0 or exp <= now_ms or hown ~= ARGV[1] or tok ~= ARGV[2] then
  return 0
end
local e = now_ms + tonumber(ARGV[3])
-- Re-entered: never cut the expiry another entry relies on.
if cnt > 1 and exp > e then
  e = exp
end
-- The holder renews: whatever was handed to it is claimed (see acquire).
save(tok, cnt, e, q, '', hown, hlab)
return 1
