-- CHARGE: run-time cost charged after the tasks ran (DRR++ post-charge, RFC 8290).
-- ARGV: sep, default key weight, then (base, level suffix, key, user, delta
--       seconds) quintuples (the level its task was fetched from: '' for the
--       first; user: '' for a one-level key).
-- Returns the number of charges applied.
SEP, DFLT = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 5 do
  charge(ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 4]), ARGV[i + 3])
end
return (#ARGV - 2) / 5
