-- bench/hostile/flood: every request a new random credential, from a random address
-- in one of NETS /24 networks of 10.0.0.0/8 (through a trusted proxy: X-Forwarded-For).
local nets = tonumber(os.getenv("NETS") or "1000")
math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16) % 1000)
request = function()
  local n = math.random(0, nets - 1)
  local addr = string.format("10.%d.%d.%d", math.floor(n / 256) % 256, n % 256, math.random(1, 254))
  return wrk.format("GET", "/search/fields", {
    ["X-API-Key"] = "flood-" .. math.random(1, 2000000000) .. "-" .. math.random(1, 2000000000),
    ["X-Forwarded-For"] = addr,
  })
end
