// Internal to fd::api: one access-log line per HTTP request, logged by the `access` logger
// after the response is written (the HTTP server's sent hook):
//   GET /v1/models 200 tokens=-/- 0.4 ms
//   POST /v1/completions 200 tokens=5/60 312.7 ms      (prompt/generated)
// Probes (GET /health, GET /metrics) log at debug so a scraper does not drown the log; every
// other request at info. Token counts come from Response::n_prompt_tokens/n_generated_tokens,
// which completion handlers fill; the time runs from the request's first byte. A client that
// went away before a non-streamed answer logs status 499.
#pragma once

#include "http/http_message.h"

namespace fd::api {

/// After the response went out: log the line.
void access_end(const Request & req, const Response & res, double ms);

}  // namespace fd::api
