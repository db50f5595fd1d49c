-- renew: a new lease for the owner. KEYS[1] record; ARGV: token, lease_ms.
-- Answers 1 if the token owned the record, 0 otherwise (nothing changed).
local record = owned_by(KEYS[1], ARGV[1])
if not record then
    return 0
end
lease_for(KEYS[1], tonumber(record[1]), tonumber(ARGV[2]))
return 1
