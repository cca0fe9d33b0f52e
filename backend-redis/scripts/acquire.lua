-- fenced-redis: take a lock, re-enter it, or queue for it. One atomic step.
--
-- ARGV[1]  owner
-- ARGV[2]  ttl in ms (validated by the client: 1 ms .. 24 h)
-- ARGV[3]  "1" if the owner may re-enter
-- ARGV[4]  the holder's label, or "" for none (kept by a re-entry)
-- ARGV[5]  waiter id (hex), or "" for a plain try (never queued)
-- ARGV[6]  the waiter's wake-up channel          (waiters only)
-- ARGV[7]  queue entry liveness in ms           (waiters only)
-- ARGV[8]  this waiter's entry from its previous attempt, or ""
-- ARGV[9]  that entry's score (arrival), or ""
--
-- Returns {1, token, count}        granted by this call
--         {2, token}               handed to this waiter earlier by a release
--         {0, pttl}                held (or the queue goes first); not queued
--         {0, pttl, entry, score}  held; the waiter is queued with this entry
--         {-1}                     held by this owner, who may not re-enter
local owner, ttl, label, wid = ARGV[1], tonumber(ARGV[2]), ARGV[4], ARGV[5]
local old = ARGV[8] or ''
local tok, cnt, exp, q, hwid, hown, hlab = load()
local now_ms, now_us, now_us_s = clock()

-- Queue the caller, keeping its place (score) if it was queued before. The
-- queue lives RETAIN ms after it was started or last refreshed (entries of
-- dead waiters are dropped when the key passes on; this only bounds leftovers).
local function enqueue(pttl, started)
  if old ~= '' then
    redis.call('ZREM', Q, old)
  end
  local score = ARGV[9]
  if not score or score == '' then
    score = now_us_s
  end
  local m = (now_ms + tonumber(ARGV[7])) .. '|' .. ttl .. '|' .. wid .. '|' .. ARGV[6] .. '|' ..
    holder(owner, label)
  redis.call('ZADD', Q, score, m)
  if started or old ~= '' then
    redis.call('PEXPIRE', Q, RETAIN)
  end
  return {0, pttl, m, score}
end

if cnt > 0 and exp > now_ms then
  if wid ~= '' and hwid == wid then
    -- Claimed: the state no longer names the waiter, so a leave in its name
    -- (its hand-over message arriving after this reply, once it stopped
    -- waiting) cannot pass the lease on.
    save(tok, cnt, exp, q, '', hown, hlab)
    return {2, tok}
  end
  if hown == owner then
    if ARGV[3] ~= '1' then
      return {-1}
    end
    -- Re-entry: the count goes up; never cut the expiry another entry relies on.
    save(tok, cnt + 1, math.max(exp, now_ms + ttl), q, hwid, hown, hlab)
    if old ~= '' then
      redis.call('ZREM', Q, old)
    end
    return {1, tok, cnt + 1}
  end
  if wid == '' then
    return {0, exp - now_ms}
  end
  if q == 0 then
    save(tok, cnt, exp, 1, hwid, hown, hlab)
  end
  return enqueue(exp - now_ms, q == 0)
end

-- Free (never held, released, or the lease ran out): queued waiters first.
if q == 1 then
  local r, handed = hand_over(tok, now_ms, now_us, now_us_s, old)
  if r == 'other' or r == 'more' then
    local pttl = handed or 0
    if wid == '' then
      return {0, pttl}
    end
    return enqueue(pttl, false)
  end
  if r == 'empty' then
    q = 0
  end
end
local t = next_token(tok, now_us, now_us_s)
save(t, 1, now_ms + ttl, q, wid, owner, label)
return {1, t, 1}
