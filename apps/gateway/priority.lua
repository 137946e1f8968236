-- Triton's priority level from the caller's priority class (HAProxy 2.6, Lua 5.3), loaded by the config
-- apps/gateway/haproxy.py renders (see apps.core.priority for the classes).
--
-- Triton takes a request's priority only from the int64 request parameter "priority" (a header forwarded to
-- it becomes a string parameter and sets nothing). For a model version whose config defines priority levels,
-- the rules set txn.plevel (the caller's class as a level) and the filter `priority_param` writes it into the
-- request's JSON (the whole body, or the JSON header of a binary request) as it streams through:
--   * into the first top-level "parameters" object, as its first member (a caller's own "priority" comes
--     after it, and Triton reads the first of duplicate members), or
--   * when there is none, as `,"parameters":{"priority":N}` before the top-level object's closing brace.
-- Whatever is written is padded with spaces to one length (INSERT_BASE + the level's digits), so the rules
-- can raise Content-Length and Inference-Header-Content-Length by it before the body is read; a body that is
-- no JSON object gets the spaces at the end of its JSON (Triton refuses it as before).
--
-- A top-level key spelled with an escape could hide a "parameters" key from the walk: such a request is
-- refused (a byte no JSON parser accepts, and txn.priority_refused for the rules' 400).

local INSERT_BASE = 27 -- #',"parameters":{"priority":}'
local MAX_KEY = 16

local Priority = {}
Priority.id = "priority parameter"
Priority.flags = filter.FLT_CFG_FL_HTX
Priority.__index = Priority

function Priority:new()
    return setmetatable({}, Priority)
end

function Priority:start_analyze(txn, chn)
    if not chn:is_resp() then
        filter.register_data_filter(self, chn)
    end
end

-- What is inserted, always INSERT_BASE + #level bytes.
local function insertion(level, where)
    local member = '"priority":' .. level
    local text
    if where == "first member" then
        text = member .. ","
    elseif where == "only member" then
        text = member
    elseif where == "new object" then
        text = ',"parameters":{' .. member .. "}"
    elseif where == "new object, only member" then
        text = '"parameters":{' .. member .. "}"
    else -- not a JSON object: spaces only
        text = ""
    end
    return text .. string.rep(" ", INSERT_BASE + #level - #text)
end

-- Insert at `offset` (bytes from the start of the incoming data), forward everything, stop filtering.
function Priority:finish(msg, offset, where)
    local text = insertion(self.level, where)
    if msg:insert(text, offset) ~= #text then
        error("priority parameter: no room in the buffer for the parameter")
    end
    filter.unregister_data_filter(self, msg.channel)
    return msg:input()
end

function Priority:refuse(txn, msg, offset, why)
    txn:set_var("txn.priority_refused", why)
    msg:set("!", offset, 1)
    return self:finish(msg, offset, "nowhere")
end

-- Offsets: the walk's state carries over from one call to the next; everything scanned is forwarded.
function Priority:http_payload(txn, msg)
    if self.level == nil then
        local level = txn:get_var("txn.plevel")
        if level == nil or txn:get_var("txn.pinsert") == nil then -- the rules did not make room for it
            filter.unregister_data_filter(self, msg.channel)
            return
        end
        self.level = tostring(level)
        self.stop = tonumber(txn:get_var("txn.jlen") or "") -- a binary request: the JSON header's length
        self.seen, self.depth = 0, 0
    end
    local available = msg:input()
    local scan = available
    if self.stop ~= nil then
        scan = math.max(math.min(available, self.stop - self.seen), 0)
    end
    local data = msg:body(0, scan) or ""
    local n = #data
    local i = 1
    if self.skip and n > 0 then -- the character after a backslash that ended the previous data
        self.skip, i = false, 2
    end
    while i <= n do
        if self.in_string then
            local j = data:find('["\\]', i)
            local upto = (j or n + 1) - 1
            if self.key ~= nil and #self.key <= MAX_KEY then
                self.key = self.key .. data:sub(i, math.min(upto, i + MAX_KEY))
            end
            if j == nil then
                break
            end
            if data:byte(j) == 92 then -- a backslash: the next character is escaped
                self.escaped = true
                if j == n then
                    self.skip = true
                end
                i = j + 2
            else
                self.in_string = false
                if self.key ~= nil then
                    self.expect = "colon"
                end
                i = j + 1
            end
        elseif self.expect ~= nil then
            local j = data:find("%S", i)
            if j == nil then
                break
            end
            local c = data:sub(j, j)
            local expect = self.expect
            self.expect = nil
            if expect == "first" then -- after the top-level "{"
                self.members = c ~= "}"
                i = j
            elseif expect == "colon" then -- after a top-level string: a key if ":" follows
                if c == ":" and self.escaped then
                    return self:refuse(txn, msg, j - 1, "a top-level key is spelled with an escape")
                end
                if c == ":" and self.key == "parameters" then
                    self.expect = "brace"
                    i = j + 1
                else
                    i = j
                end
                self.key = nil
            elseif expect == "brace" then -- the value of the first top-level "parameters"
                if c == "{" then
                    self.depth = 2
                    self.expect = "member"
                    i = j + 1
                else
                    i = j
                end
            else -- "member": the first thing inside "parameters": {
                return self:finish(msg, j - 1, c == "}" and "only member" or "first member")
            end
        else
            local j = data:find('[{}%[%]"]', i)
            if j == nil then
                break
            end
            local c = data:byte(j)
            if c == 34 then -- '"'
                self.in_string = true
                if self.depth == 1 then
                    self.key, self.escaped = "", false
                end
            elseif c == 123 or c == 91 then -- '{' '['
                self.depth = self.depth + 1
                if self.depth == 1 then
                    if c == 91 then -- a top-level array is no request
                        return self:finish(msg, scan, "nowhere")
                    end
                    self.expect = "first"
                end
            else -- '}' ']'
                if self.depth == 1 then -- the top-level object closes here
                    return self:finish(msg, j - 1, self.members and "new object" or "new object, only member")
                end
                self.depth = self.depth - 1
            end
            i = j + 1
        end
    end
    self.seen = self.seen + scan
    if msg:eom() or (self.stop ~= nil and self.seen >= self.stop) then
        return self:finish(msg, scan, "nowhere") -- the JSON ended without its object closing
    end
    return scan
end

core.register_filter("priority_param", Priority, function(priority)
    return priority
end)
