// fdctl publish --strategy rsync (STUB).
#include "offline.h"

#include "fd/status.h"

namespace fdctl {

int publish_rsync(const PublishOptions &) { fd::fail(fd::Errc::invalid_argument, "publish --strategy rsync: not implemented yet"); }

}  // namespace fdctl
