// tests/unit/noop_backend.h — a kernels::Backend base whose ops do nothing, for the unit tests'
// fake devices (they implement only the memory side: alloc, upload, download, ...).
#pragma once

#include "fd/kernels/backend.h"

namespace fd::test {

/// Every compute op a no-op; the memory methods stay pure for the fake to define.
class NoOpsBackend : public kernels::Backend {
public:
    void embedding(float *, const void *, kernels::WType, const int32_t *, int64_t, int64_t, int64_t, int64_t) override {}
    void linear(float *, const float *, const void *, kernels::WType, const float *, int64_t, int64_t, int64_t) override {}
    void rms_norm(float *, const float *, const float *, int64_t, int64_t, float) override {}
    void rope(float *, const int32_t *, const float *, int64_t, int64_t, int64_t) override {}
    void silu_mul(float *, const float *, int64_t, int64_t) override {}
    void add(float *, const float *, int64_t) override {}
    void copy_rows(float *, int64_t, const float *, int64_t, int64_t, int64_t) override {}
    void gather_rows(float *, const float *, const int32_t *, int64_t, int64_t) override {}
    void kv_store(kernels::PagedKv, const float *, const float *, const int64_t *, int64_t) override {}
    void attention_paged(float *, const float *, const kernels::AttnQuery *, int64_t, int64_t, kernels::PagedKv, float) override {}
    void log_softmax_rows(float *, const float *, int64_t, int64_t) override {}
    void argmax_rows(int64_t *, const float *, int64_t, int64_t) override {}
};

}  // namespace fd::test
