-- CHARGE: run-time cost charged after the tasks ran (DRR++ post-charge, RFC 8290).
-- ARGV: sep, default key weight, then (base, key, delta seconds) triples.
-- Returns the number of charges applied.
SEP, DFLT = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 3 do charge(ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])) end
return (#ARGV - 2) / 3
