-- fenced-redis: give a lease back; the first live waiter gets the key.
--
-- ARGV[1]  owner
-- ARGV[2]  token
--
-- Returns {2} released, {1, remaining} re-entered and still held, {0} not current.
local tok, cnt, exp, q, hwid, hown, hlab = load()
local now_ms, now_us, now_us_s = clock()
if cnt == 0 or exp <= now_ms or hown ~= ARGV[1] or tok ~= ARGV[2] then
  return {0}
end
if cnt > 1 then
  save(tok, cnt - 1, exp, q, hwid, hown, hlab)
  return {1, cnt - 1}
end
pass_on(tok, now_ms, now_us, now_us_s, q)
return {2}
