-- finalize: store the owner's response. KEYS[1] record;
-- ARGV: token, status, encoded headers, body. Answers 1 if held, 0 otherwise.
-- The record keeps its expiry: it lives its lifetime from its first submission.
if not owned_by(KEYS[1], ARGV[1]) then
    return 0
end
redis.call('HSET', KEYS[1],
    'response_status', ARGV[2], 'response_headers', ARGV[3], 'response_body', ARGV[4])
return 1
