-- gRPC per-model tenancy for the gateway (HAProxy 2.6, Lua 5.3), loaded by the config apps/gateway/haproxy.py
-- renders. Two parts:
--
-- * The action `grpc_model` reads a unary call's whole request body (the config waits for it first), which is
--   one gRPC message: a 5-byte prefix (compressed flag, big-endian length) and a KServe v2 request whose
--   field 1 is the model name and field 2 the version. Protobuf keeps the *last* value of a repeated field, so
--   reading the first bytes is not a check: every top-level field is walked (length-delimited ones are skipped
--   by their length, so MiB of tensor data cost a few steps) and a message naming the model or the version
--   twice is refused. On success it sets txn.model (and txn.gversion when a version is named); on any refusal
--   it sets txn.gerr, the config answers INVALID_ARGUMENT with it and nothing is forwarded.
-- * The filter `grpc_pin` appends the version the gateway chose (txn.gpin) to the message as a last field 2,
--   which wins (the action has refused a message that already had one), and fixes the length prefix. HAProxy
--   2.6 lets only filters change a body.

local MAX_NAME = 128
local NAME_CHARS = "^[A-Za-z0-9_.-]+$"

-- Returns value, next position; nil when the varint is truncated or longer than 10 bytes.
local function varint(s, pos, last)
    local value, shift = 0, 0
    while pos <= last and shift < 64 do
        local byte = s:byte(pos)
        value = value | ((byte & 0x7f) << shift)
        pos = pos + 1
        if byte < 0x80 then
            return value, pos
        end
        shift = shift + 7
    end
    return nil
end

-- The model name and version of one message, or nil and why it is refused.
local function parse(body, max_message)
    if body == nil or #body < 5 then
        return nil, "the request is not one complete gRPC message"
    end
    local flag = body:byte(1)
    if flag ~= 0 then
        return nil, "compressed gRPC messages are not accepted by the gateway; send them uncompressed"
    end
    local length = string.unpack(">I4", body, 2)
    if length > max_message then
        return nil, string.format("the gRPC message is larger than the gateway accepts (%d bytes)", max_message)
    end
    local last = #body
    if length ~= last - 5 then
        if length > last - 5 then
            return nil, "the gRPC message is incomplete (its length runs past the end of the request)"
        end
        return nil, "a unary call carries exactly one gRPC message"
    end
    local pos, name, version = 6, nil, nil
    while pos <= last do
        local key
        key, pos = varint(body, pos, last)
        if key == nil then
            return nil, "the message is malformed (truncated field key)"
        end
        local number, wire = key >> 3, key & 7
        if number == 0 then
            return nil, "the message is malformed (field number 0)"
        end
        if number == 1 or number == 2 then
            if wire ~= 2 then
                return nil, "the message is malformed (model_name and model_version are strings)"
            end
        end
        if wire == 0 then
            local value
            value, pos = varint(body, pos, last)
            if value == nil then
                return nil, "the message is malformed (truncated varint)"
            end
        elseif wire == 1 or wire == 5 then
            local size = wire == 1 and 8 or 4
            if pos + size - 1 > last then
                return nil, "the message is malformed (truncated fixed-size field)"
            end
            pos = pos + size
        elseif wire == 2 then
            local size
            size, pos = varint(body, pos, last)
            -- A 10-byte varint can wrap to a negative Lua integer: checked like a length past the end.
            if size == nil or size < 0 or size > last - pos + 1 then
                return nil, "the message is malformed (a length runs past the end of the message)"
            end
            if number == 1 then
                if name ~= nil then
                    return nil, "the message names model_name more than once"
                end
                if size > MAX_NAME then
                    return nil, string.format("model_name is longer than %d characters", MAX_NAME)
                end
                name = body:sub(pos, pos + size - 1)
            elseif number == 2 then
                if version ~= nil then
                    return nil, "the message names model_version more than once"
                end
                if size > 10 then
                    return nil, "model_version is not a version number"
                end
                version = body:sub(pos, pos + size - 1)
            end
            pos = pos + size
        else
            return nil, "the message is malformed (unsupported wire type)"
        end
    end
    if name == nil or name == "" then
        return nil, "the request must name a model (model_name)"
    end
    if not name:match(NAME_CHARS) then
        return nil, "model_name may hold only letters, digits, '_', '.' and '-'"
    end
    if version ~= nil and version ~= "" and not version:match("^[1-9][0-9]?[0-9]?[0-9]?[0-9]?[0-9]?[0-9]?[0-9]?[0-9]?$") then
        return nil, "model_version is not a version number"
    end
    return name, version
end

core.register_action("grpc_model", { "http-req" }, function(txn, max_message)
    local body = txn.f:req_body()
    local name, detail = parse(body, tonumber(max_message))
    if name == nil then
        txn:set_var("txn.gerr", detail)
        return
    end
    txn:set_var("txn.model", name)
    txn:set_var("txn.gsize", #body)
    if detail ~= nil and detail ~= "" then
        txn:set_var("txn.gversion", detail)
    end
end, 1)

local function encode_varint(value)
    local out = {}
    repeat
        local byte = value & 0x7f
        value = value >> 7
        if value ~= 0 then
            byte = byte | 0x80
        end
        out[#out + 1] = string.char(byte)
    until value == 0
    return table.concat(out)
end

local Pin = {}
Pin.id = "grpc version pin"
Pin.flags = filter.FLT_CFG_FL_HTX
Pin.__index = Pin

function Pin:new()
    return setmetatable({}, Pin)
end

function Pin:start_analyze(txn, chn)
    -- The rules that decide the pin run after this: every request's body passes once through http_payload.
    if not chn:is_resp() then
        filter.register_data_filter(self, chn)
    end
end

function Pin:http_payload(txn, msg)
    filter.unregister_data_filter(self, msg.channel)
    local version = txn:get_var("txn.gpin")
    if version == nil then
        return
    end
    local size = msg:input()
    -- The action has parsed this very body in full (the config waited for all of it); anything else is a
    -- request the rules did not inspect, which must never reach an instance.
    if size ~= txn:get_var("txn.gsize") then
        txn:done()
        return
    end
    local message = msg:body(5, size - 5)
    local pinned = message .. "\x12" .. encode_varint(#version) .. version
    msg:set("\0" .. string.pack(">I4", #pinned) .. pinned, 0, size)
end

core.register_filter("grpc_pin", Pin, function(pin)
    return pin
end)
