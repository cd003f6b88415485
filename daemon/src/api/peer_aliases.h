// Internal to fd::api: what the vLLM aliases (peer_aliases.cpp) and the SGLang aliases
// (sglang_aliases.cpp) share. Each alias turns a peer's request into the wire command a V1
// route builds (the same one command after control::parse_command), and the service's typed
// outcome into the peer's response shape: errors through control::render_error, success bodies
// from the outcome's fields (docs/peer_aliases.md). No alias parses the service's JSON.
#pragma once

#include "fd/engine/control.h"
#include "handlers.h"

#include <chrono>
#include <string>
#include <vector>

namespace fd::api::peer {

using control::ControlOutcome;

/// One command through the service, under the request's deadline headers (a fresh gate each).
ControlOutcome run(ApiContext & ctx, const ControlInput & in, const shm::MailboxCommand & cmd);

/// Send the peer's error shape of a failed outcome (control::render_error).
void send_error(Response & res, const ControlOutcome & o, control::Peer peer);

/// is_paused of an is_paused outcome (false when it failed).
bool paused(const ControlOutcome & o);

/// Answer `body` as JSON with `status`.
void send_json(Response & res, int status, const nlohmann::json & body);

/// Peer tags (`weights` | `weight` | `kv_cache`, comma lists allowed; with `cuda_graph_ok` also
/// SGLang's `cuda_graph`) into the one tag set (engine::TagSet; empty when none is given: the
/// route's default applies).
/// Errors  invalid_argument naming `param` for any other tag (nothing is done).
engine::TagSet map_tags(const std::vector<std::string> & given, const char * param, bool cuda_graph_ok = false);

/// Milliseconds since t0, rounded to 0.01.
double ms_since(std::chrono::steady_clock::time_point t0);

/// True while any tag is asleep.
bool sleeping(ApiContext & ctx);

/// An alias: the peer's request in, the peer's answer out.
using AliasFn = void (*)(ApiContext &, const ControlInput &, Response &);

// SGLang's routes (sglang_aliases.cpp; python/sglang/srt/entrypoints/http_server.py).
void sglang_release(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_resume(ApiContext & ctx, const ControlInput & in, Response & res);
/// The flush_cache wire mode of a cache-flush alias: "device" when `keep_host_tier` (query
/// true|false|1|0 or a JSON body boolean) keeps the host KV tier, else "" (both tiers).
/// Errors  invalid_argument.
std::string flush_mode(const ControlInput & in);
void sglang_flush_cache(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_weight_version(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_update_from_disk(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_abort_request(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_pause_generation(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_continue_generation(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_post_process_weights(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_weights_checker(ApiContext & ctx, const ControlInput & in, Response & res);
void sglang_update_from_tensor(ApiContext & ctx, const ControlInput & in, Response & res);

}  // namespace fd::api::peer
