-- wrk script: embed requests over Triton's HTTP/REST (KServe v2) protocol, one text per request, never the same
-- text twice, in one of two modes:
--
--   closed loop (RATE 0): each connection sends again the moment an answer or a refusal comes back;
--   open loop (RATE > 0): each wrk thread sends at Poisson arrivals of RATE per second until SEND_S, on whichever
--     of its connections is free (give it many more connections than requests in flight); a send that finds no
--     free connection goes late and is counted as late.
--
--   wrk -t2 -c64 -d17s --timeout 30s -s bench/wrk_embed.lua http://127.0.0.1:8000/v2/models/embed/infer \
--       -- TEXTS_FILE FROM_S TO_S RATE SEND_S [BUDGET_MS]
--
-- TEXTS_FILE: one JSON-escaped text per line (no quotes); each request appends " w<thread>_<n>" to one of them.
-- BUDGET_MS: sent as the request parameter latency_budget_ms (0 = never refused); absent: not sent.
-- An accepted request's latency (ms, send to answer) comes from the request id, which carries the send time and
-- which Triton echoes in its answer. Closed loop: counted are the answers received between FROM_S and TO_S seconds
-- after the start. Open loop: every answer counts, and the latency percentiles cover requests sent after FROM_S.
-- done() prints one line, "WRK_RESULT {json}": sent, answered, ok, refused (HTTP 503), other statuses, socket
-- errors, late sends, window_s, accepted p50/p99 ms.

local ffi = require("ffi")
ffi.cdef([[
typedef struct { long tv_sec; long tv_nsec; } wrk_embed_timespec;
int clock_gettime(int clk_id, wrk_embed_timespec *tp);
]])
local clock = ffi.new("wrk_embed_timespec")

local function now_us()
  ffi.C.clock_gettime(1, clock) -- CLOCK_MONOTONIC
  return tonumber(clock.tv_sec) * 1000000 + math.floor(tonumber(clock.tv_nsec) / 1000)
end

local threads = {}

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

function init(args)
  texts = {}
  for line in io.lines(args[1]) do
    texts[#texts + 1] = line
  end
  start_us = now_us()
  from_us = start_us + tonumber(args[2]) * 1000000
  to_us = start_us + tonumber(args[3]) * 1000000
  rate = tonumber(args[4]) / 1000000 -- arrivals per us, this thread's share; 0 = closed loop
  stop_us = start_us + tonumber(args[5] or 0) * 1000000
  next_us = start_us -- the next Poisson arrival of this thread
  parameters = args[6] and string.format('"parameters":{"latency_budget_ms":%d},', tonumber(args[6])) or ""
  sent, answered, ok, refused, other, other_status, late = 0, 0, 0, 0, 0, 0, 0
  made, due = 0, 0
  hist = {} -- accepted latency in 1 ms bins: hist[ms] = count
  math.randomseed(tid + 1)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function delay()
  due = due + 1 -- wrk calls delay() before each send, but not before its one check call of request() at start
  if rate == 0 then
    return 0
  end
  if next_us > stop_us then
    return 3600000 -- sending is over: idle until wrk stops
  end
  local at = next_us
  next_us = next_us + -math.log(1 - math.random()) / rate
  local wait_ms = (at - now_us()) / 1000
  if wait_ms < -5 then
    late = late + 1
  end
  return math.max(0, math.floor(wait_ms))
end

function request()
  made = made + 1
  if due > 0 then
    sent, due = sent + 1, due - 1
  end
  local text = texts[(tid * 7919 + made) % #texts + 1]
  local body = string.format(
    '{"id":"%d",%s"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["%s w%d_%d"]}],'
      .. '"outputs":[{"name":"EMBEDDING","parameters":{"binary_data":true}}]}',
    now_us(), parameters, text, tid, made
  )
  return wrk.format(nil, nil, nil, body)
end

function response(status, headers, body)
  local t1 = now_us()
  answered = answered + 1
  if rate == 0 and (t1 < from_us or t1 > to_us) then
    return
  end
  if status == 200 then
    ok = ok + 1
    local t0 = tonumber(string.match(body, '"id":"(%d+)"'))
    if rate == 0 or t0 >= from_us then
      local ms = math.floor((t1 - t0) / 1000)
      hist[ms] = (hist[ms] or 0) + 1
    end
  elseif status == 503 then
    refused = refused + 1
  else
    other = other + 1
    other_status = status
  end
end

local function percentile(h, total, q)
  local keys = {}
  for ms in pairs(h) do
    keys[#keys + 1] = ms
  end
  table.sort(keys)
  local seen = 0
  for _, ms in ipairs(keys) do
    seen = seen + h[ms]
    if seen >= q * total then
      return ms + 1 -- the bin's upper edge
    end
  end
  return -1
end

function done(summary, latency, requests)
  local totals = { sent = 0, answered = 0, ok = 0, refused = 0, other = 0, late = 0 }
  local h, counted, status, window_s = {}, 0, 0, 0
  for _, thread in ipairs(threads) do
    for key in pairs(totals) do
      totals[key] = totals[key] + thread:get(key)
    end
    if thread:get("other_status") ~= 0 then
      status = thread:get("other_status")
    end
    for ms, count in pairs(thread:get("hist")) do
      h[ms] = (h[ms] or 0) + count
      counted = counted + count
    end
    window_s = (thread:get("to_us") - thread:get("from_us")) / 1000000
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"sent":%d,"answered":%d,"ok":%d,"refused":%d,"other":%d,"other_status":%d,"socket_errors":%d,'
      .. '"late":%d,"window_s":%.3f,"p50_ms":%d,"p99_ms":%d}\n',
    totals.sent, totals.answered, totals.ok, totals.refused, totals.other, status,
    e.connect + e.read + e.write + e.timeout, totals.late, window_s,
    percentile(h, counted, 0.50), percentile(h, counted, 0.99)
  ))
end
