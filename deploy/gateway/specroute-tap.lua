-- specroute's response tap (Envoy's Lua filter, envoy.filters.http.lua).
--
-- What `specroute picker` learns of each answer it routed, read here in Envoy so that no chunk
-- of the answer passes through Python. Per answer it writes into the dynamic metadata
-- namespace "specroute.tap", which Envoy's access log (envoy.access_loggers.http_grpc) sends to
-- the picker once the request has ended:
--   first_us  when the first bytes of the body passed (Envoy's clock, microseconds since the
--             epoch): the picker's time to first token
--   tail      the last TAIL bytes of the body, as the backend sent them: the picker reads the
--             usage counts and the final [DONE] there with serve's own functions
-- When the picker asked the backend for the usage event on the client's behalf (metadata
-- specroute.strip_usage), that event is removed from what the client receives, as serve does.
-- Answers the picker did not route (no "specroute" metadata) are left alone.

local TAIL = 4096

-- The chunk without its usage event (an event whose data has "choices":[] and a usage object),
-- every other byte unchanged. SGLang writes each event whole, so the event is within one chunk.
local function drop_usage(data)
  for _, marker in ipairs({'"choices":[]', '"choices": []'}) do
    local at = string.find(data, marker, 1, true)
    while at ~= nil do
      local begin = 1
      local search = 1
      while true do  -- the event starts after the last blank line before the marker
        local s, e = string.find(data, "\n\r?\n", search)
        if s == nil or e >= at then break end
        begin = e + 1
        search = e + 1
      end
      local s, e = string.find(data, "\n\r?\n", at)
      local stop = (e or #data) + 1
      local event = string.sub(data, begin, stop - 1)
      if string.find(event, '"usage"', 1, true) and string.find(event, "^%s*data:") then
        data = string.sub(data, 1, begin - 1) .. string.sub(data, stop)
        at = string.find(data, marker, begin, true)
      else
        at = string.find(data, marker, stop, true)
      end
    end
  end
  return data
end

function envoy_on_response(handle)
  local routed = handle:streamInfo():dynamicMetadata():get("specroute")
  if routed == nil then
    return
  end
  local strip = routed["strip_usage"] == true
  local first = nil
  local parts, size = {}, 0  -- the body's last bytes, joined when they pass 2 x TAIL
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      if first == nil then
        first = handle:timestampString(EnvoyTimestampResolution.MICROSECOND)
      end
      local data
      if n <= TAIL or strip then
        data = chunk:getBytes(0, n)
      else
        data = chunk:getBytes(n - TAIL, TAIL)
      end
      if strip and string.find(data, '"usage"', 1, true) then
        local kept = drop_usage(data)
        if #kept ~= n then chunk:setBytes(kept) end
      end
      parts[#parts + 1] = data
      size = size + #data
      if size > 2 * TAIL then
        local joined = string.sub(table.concat(parts), -TAIL)
        parts, size = {joined}, #joined
      end
    end
  end
  local meta = handle:streamInfo():dynamicMetadata()
  if first ~= nil then
    meta:set("specroute.tap", "first_us", first)
  end
  -- metadata strings must be whole UTF-8: no cut character at the start
  local tail = string.gsub(string.sub(table.concat(parts), -TAIL), "^[\128-\191]+", "")
  meta:set("specroute.tap", "tail", tail)
end
