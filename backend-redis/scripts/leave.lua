-- fenced-redis: a waiter gives up (timeout, cancelled future, error). Its
-- entry leaves the queue; a lease handed to it that it never claimed passes
-- to the next live waiter.
--
-- ARGV[1]  waiter id
-- ARGV[2]  its queue entry, or "" when unknown (its queued attempt was cut short)
--
-- Returns 1 if an unclaimed lease was passed on, else 0.
local id, m = ARGV[1], ARGV[2]
if m ~= '' then
  redis.call('ZREM', Q, m)
else
  for _, e in ipairs(redis.call('ZRANGE', Q, 0, -1)) do
    if string.match(e, '^%d+|%d+|(%x+)|') == id then
      redis.call('ZREM', Q, e)
    end
  end
end
local tok, cnt, exp, q, hwid = load()
local now_ms, now_us, now_us_s = clock()
if cnt > 0 and exp > now_ms then
  if hwid == id then
    pass_on(tok, now_ms, now_us, now_us_s, q)
    return 1
  end
  return 0
end
if q == 1 then
  pass_on(tok, now_ms, now_us, now_us_s, q)
end
return 0
