// Internal to fd::api: one access-log line per HTTP request, logged by the `access` logger
// after the response is written (cpp-httplib's logger hook, on the thread that served it).
//   GET /v1/models 200 tokens=-/- 0.4 ms
//   POST /v1/completions 200 tokens=5/60 312.7 ms      (prompt/generated)
// Probes (GET /health, GET /metrics) log at debug so a scraper does not drown the log; every
// other request at info. The record is thread-local: httplib serves one request per thread
// from routing to the last byte written.
#pragma once

#include <httplib.h>

#include <cstdint>

namespace fd::api {

/// Start of a request (the pre-routing hook): stamps the time, clears the token counts.
void access_begin();
/// A completion handler's usage: prompt and generated tokens of the whole response.
void access_note_tokens(int64_t n_prompt, int64_t n_generated);
/// After the response went out: log the line.
void access_end(const httplib::Request & req, const httplib::Response & res);

}  // namespace fd::api
