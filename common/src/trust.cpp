#include "fd/trust.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fd {

namespace {

mode_t forbidden_bits(Trust trust) { return trust == Trust::secret ? 077 : 022; }

}  // namespace

bool is_trusted(const struct stat & st, Trust trust) { return st.st_uid == ::geteuid() && (st.st_mode & forbidden_bits(trust)) == 0; }

void check_trusted(int fd, const std::string & path, Trust trust) {
    struct stat st{};
    if (::fstat(fd, &st) != 0) { fail(Errc::internal, "{}: fstat failed: {}", path, std::strerror(errno)); }
    if (is_trusted(st, trust)) { return; }
    const uid_t me = ::geteuid();
    if (st.st_uid != me) {
        fail(Errc::forbidden,
             "{} is owned by uid {}, not by this daemon's user (uid {}): refusing to trust it (another local user could "
             "have planted it); remove it as its owner or root and let this user create it",
             path, st.st_uid, me);
    }
    fail(Errc::forbidden, "{} has mode {:04o}: {} by other users, so refusing to trust it; chmod {} it",
         path, st.st_mode & 07777, trust == Trust::secret ? "readable or writable" : "writable",
         trust == Trust::secret ? (S_ISDIR(st.st_mode) ? "0700" : "0600") : "go-w");
}

void check_trusted_path(const std::string & path, Trust trust) {
    const int fd = ::open(path.c_str(), O_PATH | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) { fail(Errc::not_found, "{}: does not exist", path); }
        fail(Errc::forbidden, "{}: cannot open to check its owner: {}", path, std::strerror(errno));
    }
    try {
        check_trusted(fd, path, trust);
    } catch (...) {
        ::close(fd);
        throw;
    }
    ::close(fd);
}

}  // namespace fd
