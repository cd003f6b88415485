// fdctl publish --strategy ipc_snapshot | ipc (STUB).
#include "offline.h"

#include "fd/status.h"

namespace fdctl {

int publish_ipc_snapshot(const PublishOptions &) { fd::fail(fd::Errc::invalid_argument, "publish --strategy ipc_snapshot: not implemented yet"); }
int publish_ipc(const PublishOptions &) { fd::fail(fd::Errc::invalid_argument, "publish --strategy ipc: not implemented yet"); }

}  // namespace fdctl
