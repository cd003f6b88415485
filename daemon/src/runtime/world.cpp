// World: the rank arithmetic and the `auto` --dist-backend rule (see fd/runtime/world.h).
#include "fd/runtime/world.h"

#include "fd/status.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace fd::runtime {

const char * dist_backend_name(DistBackend b) {
    switch (b) {
        case DistBackend::automatic: return "auto";
        case DistBackend::gloo: return "gloo";
        case DistBackend::shm: return "shm";
        case DistBackend::nccl: return "nccl";
    }
    return "?";
}

const char * executor_kind_name(ExecutorKind k) { return k == ExecutorKind::mp ? "mp" : "uni"; }

std::optional<DistBackend> parse_dist_backend(std::string_view name) {
    for (DistBackend b : {DistBackend::automatic, DistBackend::gloo, DistBackend::shm, DistBackend::nccl}) {
        if (name == dist_backend_name(b)) { return b; }
    }
    return std::nullopt;
}

std::optional<ExecutorKind> parse_executor_kind(std::string_view name) {
    if (name == "uni") { return ExecutorKind::uni; }
    if (name == "mp") { return ExecutorKind::mp; }
    return std::nullopt;
}

World World::make(int32_t tp, int32_t nnodes, int32_t n_devices, std::vector<std::string> & problems, int32_t ep) {
    World w;
    w.tp        = std::max(1, tp);
    w.nnodes    = std::max(1, nnodes);
    w.ep        = std::max(1, ep);
    w.n_devices = std::max(1, n_devices);
    if (tp < 1) { problems.push_back(fmt::format("--tensor-parallel-size {} must be >= 1", tp)); }
    if (nnodes < 1) {
        problems.push_back(fmt::format("--nnodes {} must be >= 1", nnodes));
    } else if (w.tp < nnodes || w.tp % nnodes != 0) {
        problems.push_back(fmt::format("--nnodes {} must divide --tensor-parallel-size {} (each node runs tp/nnodes ranks)", nnodes, tp));
    }
    if (ep < 1 || w.tp % w.ep != 0) { problems.push_back(fmt::format("expert-parallel size {} must be >= 1 and divide --tensor-parallel-size {}", ep, tp)); }
    if (w.tp % w.nnodes != 0) { w.nnodes = 1; }  // keep per_node() meaningful; the problem is reported
    if (w.tp % w.ep != 0) { w.ep = 1; }
    return w;
}

World World::make(int32_t tp, int32_t nnodes, int32_t n_devices, int32_t ep) {
    std::vector<std::string> problems;
    World w = make(tp, nnodes, n_devices, problems, ep);
    if (!problems.empty()) { fail(Errc::invalid_argument, "{}", fmt::join(problems, "; ")); }
    return w;
}

DistBackend resolve_dist_backend(DistBackend requested, const World & w, bool cuda, std::vector<std::string> & problems) {
    if (requested == DistBackend::shm && w.multi_node()) {
        problems.push_back(fmt::format("--dist-backend shm needs every rank on one host; --nnodes {} needs gloo (or auto)", w.nnodes));
    }
    if (requested == DistBackend::nccl) {
        if (!cuda) {
            problems.push_back("--dist-backend nccl needs --device cuda (NCCL reduces device memory); on cpu use gloo, shm or auto");
        } else if (w.multi_node()) {
            problems.push_back(fmt::format("--dist-backend nccl with --nnodes {}: NCCL across hosts is not supported yet; use gloo "
                                           "(or auto), which stages the all-reduce through host memory", w.nnodes));
        } else if (w.ranks_per_device() > 1) {
            problems.push_back(fmt::format("--dist-backend nccl: --tensor-parallel-size {} puts {} ranks on each of the {} visible CUDA "
                                           "device(s), and NCCL refuses two ranks of a group on one device (\"Duplicate GPU detected\"); "
                                           "make {} devices visible (CUDA_VISIBLE_DEVICES) or use --dist-backend auto or shm (host-staged)",
                                           w.tp, w.ranks_per_device(), w.n_devices, w.per_node()));
        }
    }
    if (requested != DistBackend::automatic) { return requested; }
    if (cuda && w.tp > 1 && !w.multi_node() && w.ranks_per_device() == 1) { return DistBackend::nccl; }
    return w.multi_node() ? DistBackend::gloo : DistBackend::shm;
}

}  // namespace fd::runtime
