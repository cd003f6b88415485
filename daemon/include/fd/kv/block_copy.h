// fd/kv/block_copy.h — one KV block copied between the device pool and the host swap pool.
//
// The scheduler's swap decisions (fd/engine/scheduler.h) are lists of these; the Worker copies
// every layer's K and V of block `src` into block `dst` (fd/model/worker.h).
#pragma once

#include <cstdint>

namespace fd::kv {

struct BlockCopy {
    int32_t src = 0;  ///< swap out: device block id; swap in: host block id
    int32_t dst = 0;  ///< swap out: host block id;   swap in: device block id
    bool operator==(const BlockCopy &) const = default;
};

}  // namespace fd::kv
