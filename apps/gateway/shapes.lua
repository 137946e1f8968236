-- Tensor shapes of KServe v2 JSON requests, checked before Triton reads them (HAProxy 2.6, Lua 5.3), loaded by
-- the config apps/gateway/haproxy.py renders.
--
-- Triton 2.51's HTTP frontend sizes an input's buffer from the "shape" it announces before it reads "data": a
-- shape of 2^40 elements with one value aborts tritonserver (std::bad_alloc) - every model on the instance,
-- every team's, until the agent has restarted it (measured; gRPC checks the shape against the model first).
-- A valid request never announces more elements than its body has bytes: a JSON value takes at least one
-- character, a binary element at least one byte. So the filter `tensor_shapes` walks the request body as it
-- is forwarded (the whole JSON, or the JSON header of a binary request: Inference-Header-Content-Length),
-- and for each `"shape": [ ... ]` multiplies the dimensions; a shape with more elements than the body's length
-- (Content-Length, or MAX_BODY when chunked) is refused. It forwards only bytes it has checked, and holds back
-- a few at the end of each chunk, where a "shape" key or a dimension may go on in the next.
--
-- A refusal turns the shape's "[" into a byte no JSON parser accepts, so Triton answers a parse error without
-- sizing anything, and sets txn.shape_refused: the config answers that request 400 with the reason.

local MAX_BODY = 64 * 1024 * 1024 -- Triton's default --http-max-input-size: a larger body is refused anyway
local HOLD = 32 -- bytes held back at the end of a chunk: '"shape"' split in two, a dimension going on
local MAX_SHAPE_TEXT = 1024 -- a "shape" array longer than this is no tensor shape: refused
local KEY = '"shape"'
-- A JSON key may spell its letters as \u escapes ("\u0073hape"), which a search for "shape" would miss. No
-- encoder escapes a plain ASCII letter, so a request that escapes one of s, h, a, p, e is refused.
local ESCAPED_LETTER = "\\u00[67]%d"

local Shapes = {}
Shapes.id = "tensor shapes"
Shapes.flags = filter.FLT_CFG_FL_HTX
Shapes.__index = Shapes

function Shapes:new()
    return setmetatable({}, Shapes)
end

function Shapes:start_analyze(txn, chn)
    if not chn:is_resp() then
        filter.register_data_filter(self, chn)
    end
end

-- The element count a shape's text announces ("1, 3, 224, 224"), or nil and why it is refused. Floats keep the
-- product exact up to 2^53, far above any limit here; a dimension of 16 digits or more is refused outright.
local function elements(text, limit)
    local count = 1.0
    for dim in text:gmatch("[^,%s]+") do
        if not dim:match("^%-?%d+$") or #dim > 15 then
            return nil, "a dimension is not an integer of at most 15 digits"
        end
        count = count * math.max(tonumber(dim) + 0.0, 0.0) -- floats: a product past 2^63 stays large
        if count > limit then
            return nil, string.format("it announces more elements than the request's %d bytes can hold", limit)
        end
    end
    return count
end

local function refuse(self, txn, msg, at, why)
    txn:set_var("txn.shape_refused", why)
    msg:set("!", at, 1)
    filter.unregister_data_filter(self, msg.channel)
end

-- The key's colon and the array's "[" after a "shape" key at `at`: the position of "[", false while the data
-- ends before them (more is needed), nil when "shape" is no key of an array here (a value, text in a string).
local function array_start(data, at)
    local from = at + #KEY
    local gap = data:match("^%s*", from)
    if from + #gap > #data then
        return false
    end
    if data:sub(from + #gap, from + #gap) ~= ":" then
        return nil
    end
    local before = data:match("^%s*", from + #gap + 1)
    local bracket = from + #gap + 1 + #before
    if bracket > #data then
        return false
    end
    return data:sub(bracket, bracket) == "[" and bracket or nil
end

-- Offsets: `self.seen` counts the body's bytes already forwarded; msg:body(0, n) are the n next ones.
function Shapes:http_payload(txn, msg)
    if self.limit == nil then
        if txn:get_var("txn.infer") == nil then -- not an inference request: nothing to check
            filter.unregister_data_filter(self, msg.channel)
            return
        end
        local length = tonumber(txn:get_var("txn.blen") or "")
        self.limit = math.max(math.min(length or MAX_BODY, MAX_BODY), 1)
        self.stop = tonumber(txn:get_var("txn.jlen") or "") -- a binary request: the JSON header's length
        self.seen, self.total, self.checked = 0, 0, 0
    end
    local available = msg:input()
    local eom = msg:eom()
    local scan = available
    if self.stop ~= nil then
        scan = math.max(math.min(available, self.stop - self.seen), 0)
    end
    local data = msg:body(0, scan) or ""
    -- Everything that is to be checked is in: the body's end, or the whole JSON header of a binary request.
    local ends = eom or (self.stop ~= nil and self.seen + scan >= self.stop)
    local forward = ends and available or math.max(scan - HOLD, 0)
    local escaped = data:find(ESCAPED_LETTER)
    if escaped ~= nil then
        return refuse(self, txn, msg, escaped - 1, "it spells a letter of a key as a unicode escape")
    end
    local from = 1
    while true do
        local at = data:find(KEY, from, true)
        if at == nil then
            break
        end
        local open = array_start(data, at)
        if open == false then
            if #data - at > MAX_SHAPE_TEXT or ends then
                return refuse(self, txn, msg, at - 1, "the shape is not followed by its array within 1 KiB")
            end
            forward = math.min(forward, at - 1) -- the ':' and '[' come with the next data
            break
        elseif open == nil then
            from = at + #KEY -- "shape" as a value or in a string: not a shape array
        else
            local finish = data:find("]", open + 1, true)
            if finish == nil then
                if #data - open > MAX_SHAPE_TEXT or ends then
                    return refuse(self, txn, msg, open - 1, "the shape array is not closed within 1 KiB")
                end
                forward = math.min(forward, at - 1) -- the rest of the array comes with the next data
                break
            end
            -- A shape held back and seen again is counted once: only shapes past what was counted add up.
            if self.seen + at > self.checked then
                local count, why = elements(data:sub(open + 1, finish - 1), self.limit)
                if count ~= nil and self.total + count > self.limit then
                    count, why = nil, string.format(
                        "its shapes announce more elements than the request's %d bytes can hold", self.limit
                    )
                end
                if count == nil then
                    return refuse(self, txn, msg, open - 1, why)
                end
                self.total, self.checked = self.total + count, self.seen + at
            end
            from = finish + 1
        end
    end
    self.seen = self.seen + forward
    if ends then -- the rest (binary tensor data after the JSON header) goes on unchecked
        filter.unregister_data_filter(self, msg.channel)
    end
    return forward
end

core.register_filter("tensor_shapes", Shapes, function(shapes)
    return shapes
end)
