-- wrk script for bench/run: POSTs a ~300-byte JSON webhook with an
-- `X-Event-Id` header, counts every answer by status and `X-Dedupe-Outcome`,
-- and prints one machine-readable result line when the run ends.
--
-- Configured by environment (bench.py sets all of them):
--   BENCH_MODE         unique: every request a new event id
--                      cycle:  ids from a pre-populated set of BENCH_KEYS keys
--   BENCH_NONCE        six digits that make this run's ids unique
--   BENCH_KEYS         size of the pre-populated set (cycle mode)
--   BENCH_THREADS      wrk's -t, to spread the threads over the set
--   BENCH_PATH         request path
--   BENCH_BODY_PREFIX  the payload before the event id
--   BENCH_BODY_SUFFIX  the payload after the event id
--
-- Event ids are 18 digits: nonce (6), thread (3), counter (9). The
-- pre-populated keys use thread 999, so both modes and the pgbench
-- baselines (PGBENCH_KEYS in bench/bench.py) use keys of the same shape and length.

local mode = os.getenv("BENCH_MODE") or "unique"
local nonce = tonumber(os.getenv("BENCH_NONCE") or "100000")
local keys = tonumber(os.getenv("BENCH_KEYS") or "0")
local nthreads = tonumber(os.getenv("BENCH_THREADS") or "1")
local path = os.getenv("BENCH_PATH") or "/hooks/orders"
local prefix = os.getenv("BENCH_BODY_PREFIX") or "{\"id\":\""
local suffix = os.getenv("BENCH_BODY_SUFFIX") or "\"}"

if mode == "cycle" and keys < 1 then
   error("BENCH_MODE=cycle needs BENCH_KEYS > 0")
end

-- Main state: the thread objects, to collect their counts in done().
local threads = {}

function setup(thread)
   thread:set("tid", #threads)
   table.insert(threads, thread)
end

-- Thread state. `tid` is set by setup() before init() runs.
local counter = 0
counts = {}

function init(args)
   if mode == "cycle" then
      counter = math.floor(tid * keys / nthreads)
   end
end

local headers = { ["Content-Type"] = "application/json", ["User-Agent"] = "bench-wrk" }

function request()
   local id
   if mode == "cycle" then
      id = string.format("%06d999%09d", nonce, counter % keys)
   else
      id = string.format("%06d%03d%09d", nonce, tid, counter)
   end
   counter = counter + 1
   headers["X-Event-Id"] = id
   return wrk.format("POST", path, headers, prefix .. id .. suffix)
end

function response(status, hdrs, body)
   local outcome = hdrs["x-dedupe-outcome"] or hdrs["X-Dedupe-Outcome"] or "none"
   local key = status .. " " .. outcome
   counts[key] = (counts[key] or 0) + 1
end

local function json_string(s)
   return "\"" .. tostring(s):gsub("[\"\\]", "\\%0") .. "\""
end

function done(summary, latency, requests)
   local merged = {}
   for _, thread in ipairs(threads) do
      local c = thread:get("counts") or {}
      for k, v in pairs(c) do
         merged[k] = (merged[k] or 0) + v
      end
   end
   local parts = {}
   for k, v in pairs(merged) do
      table.insert(parts, json_string(k) .. ":" .. string.format("%d", v))
   end
   local e = summary.errors
   io.write(string.format(
      "BENCH-RESULT {\"requests\":%d,\"duration_us\":%d,\"bytes\":%d," ..
      "\"errors\":{\"connect\":%d,\"read\":%d,\"write\":%d,\"status\":%d,\"timeout\":%d}," ..
      "\"latency_us\":{\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f,\"mean\":%.1f,\"max\":%.1f}," ..
      "\"answers\":{%s}}\n",
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency.mean, latency.max,
      table.concat(parts, ",")))
end
