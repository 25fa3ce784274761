-- ENQUEUE: publish one message to its key's list (a producer with fair_keys,
-- or a restore of a keyed message); the work is enqueue_one.lua's.
-- KEYS: none (the per-key names are built from the queue's name).
-- ARGV: base (the queue's Redis name), sep, default key weight, key, payload,
--       "1" to put it first in line (a restore) else "0", the suffix of the
--       message's priority level (Kombu's list suffix for its priority: "" for
--       the first level), the key's backlog cap ("" for none; a restore is
--       never refused), the message's publish time for a restore that keeps
--       publish order among the messages restored before it ("" for none),
--       and the user within the key for two-level keys (absent: a one-level
--       key; "" is a user, the one of messages sent without one).
-- Returns the key's list length in its level (a two-level key: its user's),
-- 0 when the queue was moved back to plain lists (celery-fair keys unkey:
-- then the message goes to Kombu's own list for its priority), or
-- {"full", backlog} when the key already has its cap of messages waiting
-- (nothing is written).
SEP, DFLT = ARGV[2], tonumber(ARGV[3])
return enqueue_message(ARGV[1], ARGV[4], ARGV[5], ARGV[6] == '1', ARGV[7] or '',
                       tonumber(ARGV[8] or ''), tonumber(ARGV[9] or ''), ARGV[10])
