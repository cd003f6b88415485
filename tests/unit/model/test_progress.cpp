// fd::Progress (daemon/src/progress.cpp) and the load phase fill_weights reports: every byte of
// the checkpoint's tensors counted once, whatever the number of threads.
#include "fd/kernels/thread_pool.h"
#include "fd/checkpoint/model_config.h"
#include "fd/checkpoint/safetensors.h"
#include "fd/model/weights.h"
#include "fd/progress.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>

namespace fs = std::filesystem;

TEST_CASE("a progress phase is visible while open and kept as last() after") {
    auto & p = fd::Progress::current();
    {
        fd::ProgressPhase ph("transfer", 1000);
        p.add_done(300);
        p.add_done(200);
        const auto s = p.snapshot();
        REQUIRE(s);
        CHECK(s->phase == "transfer");
        CHECK(s->bytes_done == 500);
        CHECK(s->bytes_total == 1000);
        CHECK(s->elapsed_s >= 0.0);
    }
    CHECK_FALSE(p.snapshot());
    REQUIRE(p.last());
    CHECK(p.last()->bytes_done == 500);
}

TEST_CASE("a phase carries the control operation it began in, whatever the op is when it is read") {
    auto & p = fd::Progress::current();
    {
        fd::ProgressPhase ph("load", 10);  // start-up: no operation
        REQUIRE(p.snapshot());
        CHECK(p.snapshot()->op.empty());
    }
    p.set_op("update_weights");
    {
        fd::ProgressPhase ph("transfer", 0);
        p.set_op("");  // the op's end is published after its phases end; a reader sees the phase's own op
        REQUIRE(p.snapshot());
        CHECK(p.snapshot()->op == "update_weights");
    }
    REQUIRE(p.last());
    CHECK(p.last()->op == "update_weights");
    {
        fd::ProgressPhase ph("load", 10);
        CHECK(p.snapshot()->op.empty());
    }
}

TEST_CASE("fill_weights reports every tensor byte of the load phase") {
    const fs::path dir = fs::path(FD_SOURCE_DIR) / "models" / "stories260K";
    const auto cfg = fd::model::load_model_config(dir);
    const auto idx = fd::model::read_tensor_index(dir);
    const auto layout = fd::model::plan_layout(cfg, idx);
    int64_t want = 0;  // stories260K is F32: the bytes read equal the bytes held
    for (const auto & t : layout.tensors) { want += t.bytes; }
    for (int threads : {0, 3}) {
        std::unique_ptr<fd::kernels::ThreadPool> pool = threads ? std::make_unique<fd::kernels::ThreadPool>(threads) : nullptr;
        std::unique_ptr<std::byte, decltype(&std::free)> base(
            static_cast<std::byte *>(std::aligned_alloc(64, (layout.arena_bytes + 63) / 64 * 64)), &std::free);
        fd::model::fill_weights(layout, idx, base.get(), pool.get());
        const auto last = fd::Progress::current().last();
        REQUIRE(last);
        CHECK(last->phase == "load");
        CHECK(last->bytes_total == want);
        CHECK(last->bytes_done == want);
        CHECK_FALSE(fd::Progress::current().snapshot());
    }
}
