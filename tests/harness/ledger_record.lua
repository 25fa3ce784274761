-- Record one entry in the ledger, at most once however often it is sent.
-- The harness sends a write again when its reply was lost (a timed-out
-- handshake or read), so the write must be idempotent: a token fresh per
-- write marks it as recorded.  A redelivered task's run is a new write with a
-- new token, so each run is still recorded.
-- KEYS[1] the hash of recorded tokens, KEYS[2] the list, KEYS[3] a hash of
--         counters (optional)
-- ARGV[1] the write's token, ARGV[2] the entry (JSON), ARGV[3] the counter's field
if redis.call('HSETNX', KEYS[1], ARGV[1], '1') == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  if KEYS[3] then
    redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
  end
  return 1
end
return 0
