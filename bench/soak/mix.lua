-- bench/soak: a mix of admitted and refused traffic from ever-new keys (or, with
-- SOAK_KEYS=N in the environment, from N callers drawn at random).
local keys = tonumber(os.getenv("SOAK_KEYS") or "") or 1000000000
local n = 0
local statuses = {}
local pad = string.rep("x", 30000)
request = function()
  n = n + 1
  local key = "soak-" .. math.random(1, keys)
  local pick = n % 10
  local headers = { ["X-API-Key"] = key, ["Content-Type"] = "application/json" }
  if pick < 4 then
    return wrk.format("GET", "/search/fields", headers)
  elseif pick < 6 then
    return wrk.format("POST", "/chats", headers, "{}")
  elseif pick == 6 then
    return wrk.format("POST", "/mcp", headers,
      '[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"start_chat"}},{"jsonrpc":"2.0","id":2,"method":"ping"}]')
  elseif pick == 7 then
    -- refused after 5 a minute per IP: mostly 429s
    return wrk.format("POST", "/oauth/register", headers, "{}")
  elseif pick == 8 then
    return wrk.format("POST", "/evals", headers, '{"pad":"' .. pad .. '"}')
  else
    -- refused before a decision: not JSON-RPC
    return wrk.format("POST", "/mcp", headers, "not json")
  end
end
response = function(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
done = function(summary, latency, requests)
  -- per-thread tables are not visible here; the 5xx count comes from wrk's Non-2xx
  -- line and sluice's own /metrics.
end
