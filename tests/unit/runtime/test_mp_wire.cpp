// What a rank process sends besides the step (daemon/src/runtime/mp_wire.h): a CUDA rank's
// device memory and group (RankDevice) and a release's device_freed_bytes survive a LinkMsg
// through a real seqpacket link; a CPU rank's reply carries none (device_id -1); which device a
// rank runs on (its index on its node modulo the devices its host sees); the spawn JSON carries
// --nnodes and the MTP draft fields.
#include "fd/runtime/rank_link.h"

#include "../../../daemon/src/runtime/mp_wire.h"

#include <doctest/doctest.h>

#include <chrono>

using namespace fd;
using namespace fd::runtime;

TEST_CASE("mp wire: device memory, tag bytes, group state and device_freed_bytes round-trip through a link") {
    RankDevice d{.rank = 1, .device = 3, .free_bytes = 123456789012, .total_bytes = 150000000000};
    for (int t = 0; t < 4; ++t) { d.held_bytes[t] = (t + 1) * 1000003LL; }
    d.comm_connected     = true;
    d.nccl_comms_live    = 1;
    d.nccl_comms_created = 2;
    RankReport rep{.rank = 1, .freed_bytes = 777, .rss_bytes = 55, .device_freed_bytes = 99999};
    LinkMsg out;
    out.rank = 1;
    rank_device_to_msg(d, out);
    rank_report_to_msg(rep, out);

    auto [a, b] = make_link_pair();
    REQUIRE(a.send(out));
    LinkMsg in;
    REQUIRE(b.recv(in, std::chrono::steady_clock::now() + std::chrono::seconds(5)) == LinkSocket::Recv::ok);
    const RankDevice e = rank_device_from_msg(in);
    CHECK(e.rank == 1);
    CHECK(e.device == 3);
    CHECK(e.free_bytes == 123456789012);
    CHECK(e.total_bytes == 150000000000);
    for (int t = 0; t < 4; ++t) { CHECK(e.held_bytes[t] == (t + 1) * 1000003LL); }
    CHECK(e.comm_connected);
    CHECK(e.nccl_comms_live == 1);
    CHECK(e.nccl_comms_created == 2);
    const RankReport r = rank_report_from_msg(in);
    CHECK(r.freed_bytes == 777);
    CHECK(r.device_freed_bytes == 99999);
    CHECK(r.rss_bytes == 55);

    // A CPU rank's reply: no device fields, no device delta.
    const LinkMsg cpu;
    CHECK(cpu.device_id == -1);
    CHECK(rank_report_from_msg(cpu).device_freed_bytes == -1);
}

TEST_CASE("mp wire: rank r runs on device (r mod ranks-per-node) mod visible devices") {
    CHECK(rank_device_id(0, 2, 1, 2) == 0);
    CHECK(rank_device_id(1, 2, 1, 2) == 1);
    CHECK(rank_device_id(1, 2, 1, 1) == 0);  // two ranks on one GPU
    CHECK(rank_device_id(3, 4, 1, 2) == 1);
    CHECK(rank_device_id(2, 4, 1, 2) == 0);
    CHECK(rank_device_id(3, 4, 2, 2) == 1);  // node 1's second rank: its own device 1
    CHECK(rank_device_id(2, 4, 2, 2) == 0);  // node 1's first rank
    CHECK(rank_device_id(5, 8, 1, 8) == 5);
    CHECK(rank_device_id(1, 2, 1, 0) == 0);  // no device count (cpu): 0
}

TEST_CASE("mp wire: the spawn configuration carries --nnodes (each host computes its ranks' devices)") {
    RankSpawn s;
    s.rank                       = 3;
    s.cfg.tensor_parallel_size   = 4;
    s.cfg.nnodes                 = 2;
    s.cfg.worker.device          = kernels::DeviceKind::cpu;
    const RankSpawn t = rank_spawn_from_json(rank_spawn_to_json(s));
    CHECK(t.cfg.nnodes == 2);
    CHECK(t.cfg.tensor_parallel_size == 4);
    CHECK(t.rank == 3);
    CHECK(t.cfg.worker.device_id == 0);  // cpu
}

TEST_CASE("mp wire: the spawn configuration carries --use-cudagraph's graph_max_batch and the scratch reservation") {
    RankSpawn s;
    s.cfg.tensor_parallel_size    = 1;
    s.cfg.worker.graph_max_batch  = 48;
    s.cfg.worker.reserve_tokens   = 4096;
    const RankSpawn t = rank_spawn_from_json(rank_spawn_to_json(s));
    CHECK(t.cfg.worker.graph_max_batch == 48);
    CHECK(t.cfg.worker.reserve_tokens == 4096);
    RankSpawn off;
    CHECK(rank_spawn_from_json(rank_spawn_to_json(off)).cfg.worker.graph_max_batch == 0);
}

TEST_CASE("mp wire: the spawn configuration carries the MTP draft fields (every rank maps its MTP cache and scratch blocks)") {
    RankSpawn s;
    s.cfg.tensor_parallel_size        = 2;
    s.cfg.worker.mtp_draft_tokens     = 3;
    s.cfg.worker.mtp_scratch_blocks   = 24;
    const RankSpawn t = rank_spawn_from_json(rank_spawn_to_json(s));
    CHECK(t.cfg.worker.mtp_draft_tokens == 3);
    CHECK(t.cfg.worker.mtp_scratch_blocks == 24);
    RankSpawn off;
    const RankSpawn u = rank_spawn_from_json(rank_spawn_to_json(off));
    CHECK((u.cfg.worker.mtp_draft_tokens == 0 && u.cfg.worker.mtp_scratch_blocks == 0));
}

TEST_CASE("mp wire: the spawn configuration carries --compute-dtype (every rank builds its backend in that mode)") {
    RankSpawn s;
    s.cfg.tensor_parallel_size = 2;
    s.cfg.worker.compute       = kernels::ComputeType::bf16;
    const auto j = rank_spawn_to_json(s);
    CHECK(j["worker"]["compute_dtype"] == "bfloat16");
    CHECK(rank_spawn_from_json(j).cfg.worker.compute == kernels::ComputeType::bf16);
    RankSpawn f32;
    CHECK(rank_spawn_from_json(rank_spawn_to_json(f32)).cfg.worker.compute == kernels::ComputeType::f32);
    auto bad = j;
    bad["worker"]["compute_dtype"] = "int8";
    CHECK_THROWS(rank_spawn_from_json(bad));
}
