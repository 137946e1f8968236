-- gRPC per-model tenancy for the gateway (HAProxy 2.6, Lua 5.3), loaded by the config apps/gateway/haproxy.py
-- renders. A unary call's body is one gRPC message: a 5-byte prefix (compressed flag, big-endian length) and a
-- KServe v2 request whose field 1 is the model name and field 2 the version. Protobuf keeps the *last* value of
-- a repeated field, so reading the first bytes is not a check: every top-level field of the whole message is
-- walked, and a message naming the model or the version twice is refused. Messages are far larger than
-- HAProxy's buffer (MiB of tensor data), so the walk has two halves:
--
-- * The action `grpc_model` reads the head of the body (the config waits until the whole body or a full
--   buffer is in): the prefix, the model name and version (which must be in the head: every protobuf
--   serializer writes fields in number order, 1 and 2 first) and every field that starts in it. On success
--   it sets txn.model (txn.gversion when a version is named), txn.gend (the message's end in the body) and
--   txn.gnext (the first byte it has not walked: the end of the body, or of a field running past the head).
--   On any refusal it sets txn.gerr and txn.gcode; the config answers with them and nothing is forwarded.
-- * The filter `grpc_walk` forwards the body while walking the rest of the message from txn.gnext: it
--   forwards only bytes it has walked, so the message's last byte reaches an instance only once every field
--   has been checked. Past the head, any model_name or model_version is refused (a repeat, or a version the
--   routing did not see); a refusal there turns the refused field's first byte into a key no protobuf
--   parser accepts, so the instance refuses the whole message before running anything. The filter also pins the version the gateway chose (txn.gpin) by inserting a model_version
--   field right after the prefix (the only one: the action has seen none in the head and the filter refuses
--   any later) and fixing the length prefix. For a version whose config defines priority levels it appends
--   Triton's `priority` parameter (txn.plevel, the caller's class) as the message's last field, so it wins
--   over any the caller sent. HAProxy 2.6 lets only filters change a body.
--
-- The service `grpc_refuse` answers every refusal of the gRPC frontend: it reads (and drops) what is left of
-- the request body first, up to a bound, because a trailers-only answer sent while the client still uploads
-- ends the stream with RST_STREAM(CANCEL) and grpcio then reports CANCELLED instead of the refusal.

local MAX_NAME = 128
local NAME_CHARS = "^[A-Za-z0-9_.-]+$"
local VERSION = "^[1-9][0-9]?[0-9]?[0-9]?[0-9]?[0-9]?[0-9]?[0-9]?[0-9]?$"
local INVALID_ARGUMENT, RESOURCE_EXHAUSTED = 3, 8

-- Returns value, next position; nil when the varint is truncated (before `last`) or longer than 10 bytes.
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
    return nil, pos
end

-- One field's header at `pos` (1-based in `s`, which holds the message's bytes up to `last`; the message ends
-- at `stop`, which may lie past `last`). Returns number, the position of its first byte after the value
-- (possibly past `last`), the value's start and size for length-delimited fields; or nil and why it is
-- refused; or false when the header itself runs past `last` (more bytes are needed).
local function field_at(s, pos, last, stop)
    local key, at = varint(s, pos, last)
    if key == nil then
        if at > last and last < stop and at - pos < 10 then
            return false
        end
        return nil, "the message is malformed (truncated field key)"
    end
    local number, wire = key >> 3, key & 7
    if number == 0 then
        return nil, "the message is malformed (field number 0)"
    end
    if (number == 1 or number == 2) and wire ~= 2 then
        return nil, "the message is malformed (model_name and model_version are strings)"
    end
    if wire == 0 then
        local value, after = varint(s, at, last)
        if value == nil then
            if after > last and last < stop and after - at < 10 then
                return false
            end
            return nil, "the message is malformed (truncated varint)"
        end
        return number, after
    elseif wire == 1 or wire == 5 then
        local after = at + (wire == 1 and 8 or 4)
        if after - 1 > stop then
            return nil, "the message is malformed (truncated fixed-size field)"
        end
        return number, after
    elseif wire == 2 then
        local size, start = varint(s, at, last)
        if size == nil then
            if start > last and last < stop and start - at < 10 then
                return false
            end
            return nil, "the message is malformed (a length runs past the end of the message)"
        end
        -- A 10-byte varint can wrap to a negative Lua integer: checked like a length past the end.
        if size < 0 or size > stop - start + 1 then
            return nil, "the message is malformed (a length runs past the end of the message)"
        end
        return number, start + size, start, size
    end
    return nil, "the message is malformed (unsupported wire type)"
end

-- The head of a request: model name, version, the message's end and the first byte not walked (1-based,
-- counting the prefix); or nil, why it is refused and the gRPC status.
local function parse_head(body, complete, max_message)
    if body == nil or #body < 5 then
        return nil, "the request is not one complete gRPC message", INVALID_ARGUMENT
    end
    if body:byte(1) ~= 0 then
        return nil, "compressed gRPC messages are not accepted by the gateway; send them uncompressed",
            INVALID_ARGUMENT
    end
    local length = string.unpack(">I4", body, 2)
    if length > max_message then
        return nil, string.format(
            "the gRPC message (%d bytes) is larger than the %d bytes (%.1f MiB) the gateway accepts "
                .. "(GATEWAY_GRPC_MAX_MESSAGE_BYTES)", length, max_message, max_message / 1048576),
            RESOURCE_EXHAUSTED
    end
    local last, stop = #body, 5 + length
    if complete and length ~= last - 5 then
        if length > last - 5 then
            return nil, "the gRPC message is incomplete (its length runs past the end of the request)",
                INVALID_ARGUMENT
        end
        return nil, "a unary call carries exactly one gRPC message", INVALID_ARGUMENT
    end
    if last > stop then
        return nil, "a unary call carries exactly one gRPC message", INVALID_ARGUMENT
    end
    local pos, name, version = 6, nil, nil
    while pos <= last do
        local number, after, start, size = field_at(body, pos, last, stop)
        if number == false then
            break -- a field header across the end of the head: the filter walks on from it
        elseif number == nil then
            return nil, after, INVALID_ARGUMENT
        end
        if number == 1 or number == 2 then
            if after - 1 > last then
                return nil, "model_name and model_version must come before the tensor data", INVALID_ARGUMENT
            end
            local value = body:sub(start, start + size - 1)
            if number == 1 then
                if name ~= nil then
                    return nil, "the message names model_name more than once", INVALID_ARGUMENT
                end
                if size > MAX_NAME then
                    return nil, string.format("model_name is longer than %d characters", MAX_NAME),
                        INVALID_ARGUMENT
                end
                name = value
            else
                if version ~= nil then
                    return nil, "the message names model_version more than once", INVALID_ARGUMENT
                end
                if size > 10 then
                    return nil, "model_version is not a version number", INVALID_ARGUMENT
                end
                version = value
            end
        end
        pos = after
    end
    if name == nil or name == "" then
        return nil, "the request must name a model (model_name) before its tensor data", INVALID_ARGUMENT
    end
    if not name:match(NAME_CHARS) then
        return nil, "model_name may hold only letters, digits, '_', '.' and '-'", INVALID_ARGUMENT
    end
    -- An empty version (which no protobuf serializer writes) would follow the pin and undo it.
    if version ~= nil and not version:match(VERSION) then
        return nil, "model_version is not a version number (leave the field out for the default)",
            INVALID_ARGUMENT
    end
    return name, version, stop, pos
end

core.register_action("grpc_model", { "http-req" }, function(txn, max_message)
    local body = txn.f:req_body()
    -- The config waited for the whole body or a full buffer: a channel that may still receive holds it all.
    local name, detail, code_or_end, next_byte = parse_head(body, txn.req:may_recv(), tonumber(max_message))
    if name == nil then
        txn:set_var("txn.gerr", detail)
        txn:set_var("txn.gcode", code_or_end)
        return
    end
    txn:set_var("txn.model", name)
    -- 0-based offsets in the body, as the filter counts.
    txn:set_var("txn.gend", code_or_end)
    txn:set_var("txn.gnext", next_byte - 1)
    if detail ~= nil then
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

-- ModelInferRequest's `parameters` (field 4, map<string, InferParameter>) entry "priority" -> int64_param
-- (InferParameter field 2) `level`, as Triton reads a request's priority; "" without a level.
local function priority_entry(level)
    if level == nil or not tostring(level):match("^[0-9][0-9]?[0-9]?[0-9]?$") then
        return ""
    end
    local value = "\x10" .. encode_varint(tonumber(level))
    local entry = "\x0a\x08priority\x12" .. encode_varint(#value) .. value
    return "\x22" .. encode_varint(#entry) .. entry
end

local Walk = {}
Walk.id = "grpc message walk"
Walk.flags = filter.FLT_CFG_FL_HTX
Walk.__index = Walk

function Walk:new()
    return setmetatable({}, Walk)
end

function Walk:start_analyze(txn, chn)
    -- The rules that set what the walk needs run before the body is forwarded.
    if not chn:is_resp() then
        filter.register_data_filter(self, chn)
    end
end

-- A key of field 1 with wire type 7, which no protobuf parser accepts: a message holding it is refused whole
-- when the instance's gRPC server deserializes it, before any handler runs.
local INVALID_KEY = "\x0f"

-- Refuses the call at `at`, the start of a field the walk refused (not forwarded yet: the walk forwards only
-- bytes it has checked): its first byte becomes INVALID_KEY and the rest of the body goes on as sent, so the
-- stream ends as streams do on both sides and the instance refuses the message. Ending the transaction from the
-- filter (txn:done()) instead left the stream to the instance open until the server timeout - a session a
-- hostile client could pile up with malformed calls.
local function abort(self, txn, msg, why, at)
    txn:set_var("txn.gabort", why)
    msg:set(INVALID_KEY, at - self.base + (self.extra or 0), 1)
    filter.unregister_data_filter(self, msg.channel)
end

function Walk:http_payload(txn, msg)
    if self.stop == nil then
        local stop = txn:get_var("txn.gend")
        -- Not a model call, or one the rules refused (the refusal service reads what is left).
        if stop == nil or txn:get_var("txn.gmsg") ~= nil then
            filter.unregister_data_filter(self, msg.channel)
            return
        end
        self.stop, self.next, self.base = stop, txn:get_var("txn.gnext"), 0
        local version = txn:get_var("txn.gpin")
        self.tail = priority_entry(txn:get_var("txn.plevel"))
        if version ~= nil or self.tail ~= "" then
            -- msg offsets are relative to the first byte this filter has not forwarded: 0 is the prefix.
            local pin = version and ("\x12" .. encode_varint(#version) .. version) or ""
            if msg:input() < 5 then
                return 0 -- the prefix is in the head the action read: it comes with the next data
            end
            msg:set("\0" .. string.pack(">I4", stop - 5 + #pin + #self.tail) .. pin, 0, 5)
            self.extra = #pin -- bytes in front of the original ones, forwarded with them
        end
    end
    local extra = self.extra or 0
    local available = self.base + msg:input() - extra -- the end (exclusive) of the original bytes in
    while self.next < self.stop and self.next < available do
        -- A field header is at most 20 bytes (a key and a length, or a key and a varint value).
        local window = msg:body(self.next - self.base + extra, math.min(20, available - self.next))
        local last = #window
        local number, after = field_at(window, 1, last, self.stop - self.next)
        if number == false then
            if msg:eom() then
                return abort(self, txn, msg, "truncated field", self.next)
            end
            break -- the rest of the header comes with the next data
        elseif number == nil then
            return abort(self, txn, msg, after, self.next)
        elseif number == 1 or number == 2 then
            return abort(self, txn, msg, "model_name or model_version after the message's head", self.next)
        end
        self.next = self.next + after - 1
    end
    if self.next >= self.stop and available > self.stop then
        -- Every field of the call's message was checked; what follows it is a second message, which a unary
        -- method never reads as its request. It goes on as sent, and the server refuses the extra message.
        txn:set_var("txn.gabort", "more than one gRPC message")
        filter.unregister_data_filter(self, msg.channel)
        return
    end
    local forward = math.min(self.next, available) - self.base
    self.base = self.base + forward
    self.extra = 0
    if self.next >= self.stop and available == self.stop then
        if self.tail ~= "" then
            -- The priority parameter, last: a caller's own "priority" entry comes before it, and protobuf
            -- keeps the last entry of a map key. The prefix announced its bytes.
            if msg:insert(self.tail, forward + extra) ~= #self.tail then
                error("grpc priority: no room in the buffer for the parameter")
            end
            forward = forward + #self.tail
        end
        filter.unregister_data_filter(self, msg.channel)
    end
    return forward + extra
end

core.register_filter("grpc_walk", Walk, function(walk)
    return walk
end)

-- Every refusal of the gRPC frontend: txn.gmsg is "<grpc status> <message>". The rest of the request body is
-- read and dropped first (at most `limit` bytes, then the answer goes anyway), so the client sees the status.
core.register_service("grpc_refuse", "http", function(applet)
    local limit = tonumber(applet:get_var("txn.glimit")) or 0
    local refusal = applet:get_var("txn.gmsg") or "13 the gateway refused the call"
    local drained = 0
    while drained <= limit do
        local chunk = applet:receive(65536)
        if chunk == nil or #chunk == 0 then
            break
        end
        drained = drained + #chunk
    end
    local code, message = refusal:match("^(%d+) (.*)$")
    applet:set_status(200)
    applet:add_header("content-type", "application/grpc")
    applet:add_header("grpc-status", code or "13")
    applet:add_header("grpc-message", message or refusal)
    applet:add_header("content-length", "0")
    applet:start_response()
end)
