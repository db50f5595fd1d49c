-- release: delete the owner's in-flight record, so a retry runs again.
-- KEYS[1] record; ARGV: token. Answers 1 if held, 0 otherwise.
if not owned_by(KEYS[1], ARGV[1]) then
    return 0
end
redis.call('DEL', KEYS[1])
return 1
