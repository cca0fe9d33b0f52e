-- fenced-redis fence: write a value only if its fencing token is at least the
-- highest token seen for it. Standalone (not prefixed by prelude.lua: it
-- touches the caller's keys, not a lock's state).
--
-- KEYS[1]  the value key (the caller's)
-- KEYS[2]  its fence key, in the same hash slot (see src/fence.rs): the
--          highest accepted token as a decimal string, never expiring —
--          forgetting it would let a stale holder in again
-- ARGV[1]  the token: decimal, 1 to 2^64-1, no leading zeros
-- ARGV[2]  the value
-- ARGV[3]  the value's expiry in ms, or '0' for none
--
-- Returns {1, token} accepted (value and fence written),
--         {0, highest} stale (nothing written).
--
-- Tokens are compared as decimal strings, digit by digit: Lua numbers are
-- doubles, exact only below 2^53, and `<` on strings follows the server's
-- locale (strcoll).
local V, F = KEYS[1], KEYS[2]
local tok, val, px = ARGV[1], ARGV[2], ARGV[3]

local function below(a, b)
  if #a ~= #b then
    return #a < #b
  end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return false
end

local highest = redis.call('GET', F)
if highest then
  if #highest > 20 or not string.match(highest, '^[1-9]%d*$') then
    error({err = 'fenced: unexpected value under ' .. F .. ' (not a fencing token)'})
  end
  if below(tok, highest) then
    return {0, highest}
  end
end
if px == '0' then
  redis.call('SET', V, val)
else
  redis.call('SET', V, val, 'PX', px)
end
redis.call('SET', F, tok)
return {1, tok}
