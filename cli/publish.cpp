// fdctl publish: dispatch to the strategy's publisher.
#include "offline.h"

namespace fdctl {

int run_publish(const PublishOptions & o) {
    if (o.strategy == "rsync") { return publish_rsync(o); }
    if (o.strategy == "ipc_snapshot") { return publish_ipc_snapshot(o); }
    if (o.strategy == "ipc_delta") { return publish_ipc_delta(o); }
    return publish_ipc(o);
}

}  // namespace fdctl
