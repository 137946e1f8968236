-- Scale to zero: hold a request for a sleeping model at the gateway until a replica serves it (HAProxy 2.6,
-- Lua 5.3), loaded by the config apps/gateway/haproxy.py renders.
--
-- The action `hold_asleep` runs for models whose deployment may sleep (sleepy.map gives their deployment
-- key, e.g. d12, in txn.sleepy). While the deployment's backend slot (txn.backend) has no usable server
-- (the nbsrv fetch: servers up and in rotation) it signals the platform - an entry <key> <epoch ms it
-- began holding> in wakeups.map, and a connection to the gateway command's wake socket (TGP_WAKE_SOCKET)
-- that makes it read the map at once instead of at its next poll (GATEWAY_WAKE_POLL_MS; the map alone
-- still wakes it if the socket is not there) - and sleeps in short steps (core.msleep yields: no thread is blocked, and sleeping does not count against Lua's
-- execution timeout). Once a server is usable the request goes on, and how long it was held is written to
-- coldstart.map (<key> <ms>) for the deployment's page. Past the activation timeout it sets txn.wake_failed
-- and the config answers 503 with Retry-After (gRPC: UNAVAILABLE). The signal is repeated every second: a gateway restart or a
-- lost entry only delays the wake-up. A wake-up that failed (no replica could load: the platform writes
-- <key> <reason, percent-encoded> into wakefail.map) ends the wait at once: txn.wake_reason (JSON-safe) and
-- txn.wake_code (as gRPC's grpc-message wants it) carry the reason into the 503 / UNAVAILABLE.

local WAKEUPS = os.getenv("TGP_WAKEUPS_MAP")
local COLDSTART = os.getenv("TGP_COLDSTART_MAP")
-- core.set_map only writes maps HAProxy has loaded; loading them here makes sure they are.
Map.new(WAKEUPS, Map._str)
Map.new(COLDSTART, Map._str)
local FAILURES = Map.new(os.getenv("TGP_WAKEFAIL_MAP"), Map._str)
local WAKE_SOCKET = os.getenv("TGP_WAKE_SOCKET")

-- The platform writes only [A-Za-z0-9 .,:;()_/-] into a reason before encoding it: decoded, it is JSON-safe.
local function decoded(value)
    return (value:gsub("%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end

-- A held request goes on at most this long after its server entered the rotation.
local STEP_MS = 10
local SIGNAL_EVERY_MS = 1000

-- Best effort: the entry in wakeups.map is the signal; this only says "read it now".
local function signal_now(key)
    if WAKE_SOCKET == nil or WAKE_SOCKET == "unix@" then
        return
    end
    local socket = core.tcp()
    socket:settimeout(1)
    if socket:connect(WAKE_SOCKET) then
        socket:send(key .. "\n")
    end
    socket:close()
end

local function elapsed_ms(start)
    local now = core.now()
    return (now.sec - start.sec) * 1000 + (now.usec - start.usec) // 1000
end

-- A failed wake-up of the deployment: the reason into txn.wake_reason / txn.wake_code (the 503 answers it).
local function failed(txn, key)
    local failure = FAILURES:lookup(key)
    if failure == nil or failure == "" then
        return false
    end
    txn:set_var("txn.wake_code", failure)
    txn:set_var("txn.wake_reason", decoded(failure))
    return true
end

-- prefix: "" for the HTTP slot, "g" for its gRPC twin (the same placements on their gRPC ports).
local function hold(txn, timeout_ms, prefix)
    local slot = txn:get_var("txn.backend")
    if slot ~= nil then
        slot = prefix .. slot
    end
    local key = txn:get_var("txn.sleepy")
    if slot == nil or key == nil then
        return
    end
    -- First the failure: a replica that failed to load is in rotation until its health check says so.
    if failed(txn, key) or txn.f:nbsrv(slot) > 0 then
        return
    end
    timeout_ms = tonumber(timeout_ms)
    local start = core.now()
    local signalled = -SIGNAL_EVERY_MS
    while true do
        local waited = elapsed_ms(start)
        if failed(txn, key) then
            return
        end
        if txn.f:nbsrv(slot) > 0 then
            txn:set_var("txn.held_ms", waited)
            core.set_map(COLDSTART, key, tostring(waited))
            return
        end
        if waited >= timeout_ms then
            txn:set_var("txn.wake_failed", 1)
            return
        end
        if waited - signalled >= SIGNAL_EVERY_MS then
            core.set_map(WAKEUPS, key, tostring(start.sec * 1000 + start.usec // 1000))
            signal_now(key)
            signalled = waited
        end
        core.msleep(STEP_MS)
    end
end

core.register_action("hold_asleep", {"http-req"}, function(txn, timeout_ms)
    hold(txn, timeout_ms, "")
end, 1)

-- The gRPC frontend's model calls: the same wait, on the slot's gRPC twin.
core.register_action("hold_asleep_grpc", {"http-req"}, function(txn, timeout_ms)
    hold(txn, timeout_ms, "g")
end, 1)
