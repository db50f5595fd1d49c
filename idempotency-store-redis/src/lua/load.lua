-- load: the live record, or nil. KEYS[1] record; no ARGV.
return live_record(KEYS[1])
