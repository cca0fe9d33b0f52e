-- fenced-redis: who holds the key, read in one atomic step.
--
-- Returns {0} free, or {1, owner, token, count, pttl, label} (label '' for none).
local tok, cnt, exp, q, hwid, hown, hlab = load()
local now_ms = clock()
if cnt == 0 or exp <= now_ms then
  return {0}
end
return {1, hown, tok, cnt, exp - now_ms, hlab}
