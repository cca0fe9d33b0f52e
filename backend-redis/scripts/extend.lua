-- fenced-redis: push current leases' expiry to ttl from now. Never creates a
-- lock. One lease per key of KEYS (state keys only: the queue is not touched);
-- several in one call renew a batch (one server, or one slot of a cluster).
--
-- ARGV[1]        ttl in ms
-- ARGV[2i]       owner of the lease on KEYS[i]
-- ARGV[2i + 1]   its token (decimal, as granted)
--
-- Returns one number per key: 1 extended, 0 the lease is not current
-- (expired, released, or another holder).
local ttl = tonumber(ARGV[1])
local now_ms = clock()
local out = {}
for i = 1, #KEYS do
  -- `load` and `save` work on S (see the prelude).
  S = KEYS[i]
  local owner, token = ARGV[2 * i], ARGV[2 * i + 1]
  local tok, cnt, exp, q, hwid, hown, hlab = load()
  if cnt == 0 or exp <= now_ms or hown ~= owner or tok ~= token then
    out[i] = 0
  else
    local e = now_ms + ttl
    -- Re-entered: never cut the expiry another entry relies on.
    if cnt > 1 and exp > e then
      e = exp
    end
    -- The holder renews: whatever was handed to it is claimed (see acquire).
    save(tok, cnt, e, q, '', hown, hlab)
    out[i] = 1
  end
end
return out
