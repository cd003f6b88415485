// cli/progress_bar.h — while a long control call (wakeup, update-weights, update-model-weight)
// runs, poll the daemon's GET /health `progress` (bytes done / total of the phase running now)
// and draw one line on stderr:
//   update_weights load [##########..........]  51%  561.2 / 1100.0 MiB  0.8 s
// Only when stderr is a terminal and neither --quiet nor --json is given; the line is erased
// when the call returns. Best effort: a daemon that does not answer /health just draws nothing.
// The shm transport polls http://127.0.0.1:PORT (the daemon serves HTTP on the same host).
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace fdctl {

class ProgressBar {
public:
    /// `url`: the daemon's base URL; `api_key` is sent when not empty (GET /health needs none).
    ProgressBar(std::string url, std::string api_key, std::string op);
    ~ProgressBar();  ///< stops, erases the line

    /// The bar line for a /health `progress` object (JSON text), `width` columns of bar.
    /// Empty when the object is null. Exposed for tests.
    static std::string render(const std::string & op, const std::string & progress_json, int width = 20);

private:
    void run();

    std::string             url_, api_key_, op_;
    std::mutex              mu_;
    std::condition_variable cv_;
    bool                    stop_ = false;
    bool                    drawn_ = false;
    std::thread             thread_;
};

}  // namespace fdctl
