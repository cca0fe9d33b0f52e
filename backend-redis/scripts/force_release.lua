-- fenced-redis: administrative release, whoever holds the key; the first
-- live waiter gets it.
--
-- Returns 1 if a current lease was removed, else 0.
local tok, cnt, exp, q = load()
local now_ms, now_us, now_us_s = clock()
local held = cnt > 0 and exp > now_ms
if cnt > 0 or q == 1 then
  pass_on(tok, now_ms, now_us, now_us_s, q)
end
if held then
  return 1
end
return 0
