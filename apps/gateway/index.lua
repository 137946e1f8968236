-- GET /v2/models through the gateway: the caller's team's callable models (HAProxy 2.6, Lua 5.3), loaded by
-- the config apps/gateway/haproxy.py renders. The token check has set txn.team; index.map holds, per team,
-- "<team> <count>" and "<team>.<i> <model>/<versions, comma-separated>/<READY|ASLEEP>" (written by the
-- platform from what it routes: apps.gateway.state). Only [a-z0-9_-] names, digits and upper-case states
-- reach the body, so it needs no escaping.

local INDEX = Map.new(os.getenv("TGP_INDEX_MAP"), Map._str)

local function entry_json(entry)
    local name, versions, state = entry:match("^([a-z0-9_-]+)/([0-9,]*)/(%u+)$")
    if name == nil then
        return nil
    end
    local quoted = {}
    for version in versions:gmatch("%d+") do
        quoted[#quoted + 1] = '"' .. version .. '"'
    end
    return string.format('{"name":"%s","versions":[%s],"state":"%s"}', name, table.concat(quoted, ","), state)
end

core.register_service("models_index", "http", function(applet)
    local team = applet:get_var("txn.team") or ""
    local models = {}
    local count = tonumber(INDEX:lookup(team) or "0") or 0
    for i = 0, count - 1 do
        local entry = INDEX:lookup(team .. "." .. i)
        local json = entry and entry_json(entry)
        if json then
            models[#models + 1] = json
        end
    end
    local body = '{"models":[' .. table.concat(models, ",") .. "]}"
    applet:set_status(200)
    applet:add_header("content-type", "application/json")
    applet:add_header("content-length", tostring(#body))
    applet:start_response()
    applet:send(body)
end)
