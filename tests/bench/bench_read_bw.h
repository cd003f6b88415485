// tests/bench/bench_read_bw.h — fd_bench's memory reference: how fast one thread (or N pinned
// threads) reads a touched buffer, the figure every "÷ read bandwidth" ratio of fd_bench divides
// by, and memcpy for reference. Bench code only.
#pragma once

#include "bench_kernels.h"  // Mapping

#include <nlohmann/json.hpp>

#include <cstddef>

namespace fd::bench {

/// One read-bandwidth probe of `m`: `passes` passes over the whole buffer, each summing it on
/// `n_threads` threads pinned to CPUs 0, 1, ... (one contiguous slice each, read front to back:
/// one stream per thread), started together. Per pass: GB/s (1e9 B/s) by wall time and by the
/// slowest thread's CPU time (time slices other processes took do not count). Returns {best,
/// median, worst} by wall time, {best_cpu_time, median_cpu_time}, passes, threads_pinned; the
/// best wall pass is the reference of fd_bench's ratios (issue #14: best-of-3 moved 2x here).
nlohmann::ordered_json read_bw_probe(const Mapping & m, int n_threads, int passes);

/// One thread reading `m` as S sequential streams side by side (S equal parts, 64 bytes of each
/// per step), for S = 2, 4 and 8, `passes` passes each: the best GB/s by wall time over every S
/// and pass, with the S that gave it. One core reads several streams faster than one (1.2-1.3x on
/// the AMD EPYC of issue 28: more lines in flight), and the GEMV (4 streams) and the decode
/// attention's K walk (4 blocks at once) read that way, so this is the stricter reference for
/// their "÷ read bandwidth" (fd_linear_bf16_bench's read_bw_streams_gbs, on the whole buffer).
nlohmann::ordered_json read_bw_streams_probe(const Mapping & m, int passes);

/// The memory reference of one fd_bench run, on a `bytes` buffer in 2 MiB pages (as the daemon's
/// arenas), every page touched first: single_thread_probe / single_thread (its best), with
/// n_threads > 1 multi_thread_probe / multi_thread, single_thread_streams_probe /
/// single_thread_streams (read_bw_streams_probe's best), memcpy_single_thread (GB/s copied, half
/// the buffer into a second one, best of 3).
nlohmann::ordered_json memory_bandwidth(size_t bytes, int n_threads);

}  // namespace fd::bench
