// StagedComm: a host comm (gloo, shm) for ranks whose tensors live in device memory; every
// collective goes device -> pinned host -> the host comm -> device (fd/comm/comm.h).
#include "fd/kernels/backend.h"
#include "fd/comm/comm.h"
#include "fd/status.h"

#include <vector>

namespace fd::comm {
namespace {

class StagedComm final : public Comm {
public:
    StagedComm(std::unique_ptr<Comm> host, bool always_stage) : host_(std::move(host)), always_(always_stage) {
        FD_CHECK(host_, "a staged comm needs a host comm");
    }
    ~StagedComm() override { free_buffer(); }

    const char * name() const override { return host_->name(); }
    int32_t rank() const override { return host_->rank(); }
    int32_t world_size() const override { return host_->world_size(); }
    bool connected() const override { return host_->connected(); }
    void connect(int64_t generation) override { host_->connect(generation); }
    void disconnect() override { host_->disconnect(); }
    void barrier() override { host_->barrier(); }

    void use_backend(kernels::Backend * backend) override {
        free_buffer();
        backend_ = backend;
        stage_   = backend != nullptr && (always_ || !backend->host_visible());
        host_->use_backend(nullptr);  // the host comm only ever sees host memory
    }

    void all_reduce_sum(float * data, int64_t n) override {
        if (!stage_) {
            host_->all_reduce_sum(data, n);
            return;
        }
        float * h = buffer(n);
        backend_->download(h, data, bytes(n));  // waits for the ops that wrote `data`
        host_->all_reduce_sum(h, n);
        backend_->upload(data, h, bytes(n));
    }

    void gather(const float * send, int64_t n, float * recv) override {
        if (!stage_) {
            host_->gather(send, n, recv);
            return;
        }
        const bool    root = rank() == 0;
        const int64_t all  = root ? int64_t{world_size()} * n : 0;
        float *       h    = buffer(n + all);  // [n] this rank's part, then rank 0's [world, n]
        backend_->download(h, send, bytes(n));
        host_->gather(h, n, root ? h + n : nullptr);
        if (root) { backend_->upload(recv, h + n, bytes(all)); }
    }

    void all_gather(const float * send, int64_t n, float * recv) override {
        if (!stage_) {
            host_->all_gather(send, n, recv);
            return;
        }
        const int64_t all = int64_t{world_size()} * n;
        float *       h   = buffer(n + all);  // [n] this rank's part, then [world, n]
        backend_->download(h, send, bytes(n));
        host_->all_gather(h, n, h + n);
        backend_->upload(recv, h + n, bytes(all));
    }

private:
    static int64_t bytes(int64_t n) { return n * static_cast<int64_t>(sizeof(float)); }

    /// At least `n` floats of host memory: pinned where the backend has it, else ordinary.
    float * buffer(int64_t n) {
        if (n <= cap_) { return data_; }
        free_buffer();
        const int64_t want = n + n / 4;
        if (void * p = backend_->alloc_pinned_host(bytes(want))) {
            data_   = static_cast<float *>(p);
            pinned_ = true;
        } else {
            plain_.resize(static_cast<size_t>(want));
            data_ = plain_.data();
        }
        cap_ = want;
        return data_;
    }

    void free_buffer() noexcept {
        if (pinned_ && backend_) { backend_->free_pinned_host(data_); }
        plain_.clear();
        plain_.shrink_to_fit();
        data_   = nullptr;
        cap_    = 0;
        pinned_ = false;
    }

    std::unique_ptr<Comm> host_;
    bool                  always_  = false;
    kernels::Backend *    backend_ = nullptr;
    bool                  stage_   = false;
    float *               data_    = nullptr;  ///< [cap_] staging floats
    int64_t               cap_     = 0;
    bool                  pinned_  = false;
    std::vector<float>    plain_;              ///< the buffer where the backend has no pinned memory
};

}  // namespace

std::unique_ptr<Comm> make_staged_comm(std::unique_ptr<Comm> host, bool always_stage) {
    return std::make_unique<StagedComm>(std::move(host), always_stage);
}

}  // namespace fd::comm
