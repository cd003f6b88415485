// fd/trust.h (common/src/trust.cpp): what the daemon may trust — owned by its effective user, not
// writable (secrets: not accessible) by group or others, checked on the open descriptor.
#include "fd/trust.h"
#include "fd/file_io.h"
#include "fd/status.h"
#include "../test_util.h"

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <tuple>

namespace fs = std::filesystem;
using fd::Errc;
using fd::Trust;
using fd::test::TempDir;

namespace {

/// The message of the forbidden error check_trusted_path throws, or "" when it passes.
std::string refusal(const fs::path & p, Trust t) {
    try {
        fd::check_trusted_path(p.string(), t);
    } catch (const fd::Error & e) {
        CHECK(e.code() == Errc::forbidden);
        return e.what();
    }
    return "";
}

}  // namespace

TEST_SUITE("trust") {

TEST_CASE("forbidden is in the one error table: 403, its own fdctl exit code") {
    CHECK(fd::errc_http_status(Errc::forbidden) == 403);
    CHECK(fd::errc_name(Errc::forbidden) == "forbidden");
    CHECK(fd::errc_from_name("forbidden") == Errc::forbidden);
    CHECK(fd::errc_info(Errc::forbidden).exit_code == 13);
    for (const auto & e : fd::kErrcTable) {
        if (e.code != Errc::forbidden) { CHECK(e.exit_code != 13); }
    }
}

TEST_CASE("a file of this user passes by its mode: group/other write refused, for secrets any group/other bit") {
    TempDir d;
    const auto f = d.path / "record";
    std::ofstream(f) << "x";
    for (auto [mode, owned_ok, secret_ok] : {std::tuple{0600, true, true}, {0644, true, false}, {0640, true, false},
                                             {0620, false, false}, {0602, false, false}, {0400, true, true}}) {
        CAPTURE(mode);
        REQUIRE(::chmod(f.c_str(), static_cast<mode_t>(mode)) == 0);
        CHECK(refusal(f, Trust::owned).empty() == owned_ok);
        const std::string m = refusal(f, Trust::secret);
        CHECK(m.empty() == secret_ok);
        if (!m.empty()) {
            CHECK(m.find(f.string()) != std::string::npos);
            CHECK(m.find(fmt::format("{:04o}", mode)) != std::string::npos);
        }
    }
    REQUIRE(::chmod(d.path.c_str(), 0777) == 0);
    CHECK(refusal(d.path, Trust::owned).find("0777") != std::string::npos);
    REQUIRE(::chmod(d.path.c_str(), 0755) == 0);
    CHECK(refusal(d.path, Trust::owned).empty());
}

TEST_CASE("a file owned by another uid is refused naming the owner, checked on the descriptor") {
    if (::geteuid() != 0) {
        MESSAGE("skipped: needs root to chown a file to another uid");
        return;
    }
    TempDir d;
    const auto f = d.path / "planted";
    std::ofstream(f) << "x";
    REQUIRE(::chmod(f.c_str(), 0600) == 0);
    REQUIRE(::chown(f.c_str(), 65534, 65534) == 0);
    const std::string m = refusal(f, Trust::secret);
    CHECK(m.find("uid 65534") != std::string::npos);
    CHECK(m.find(f.string()) != std::string::npos);
    // Same on an open fd, even after the path was swapped for a file of ours.
    const fd::UniqueFd fd(::open(f.c_str(), O_RDONLY | O_CLOEXEC));
    fs::remove(f);
    std::ofstream(f) << "mine";
    REQUIRE(::chmod(f.c_str(), 0600) == 0);
    CHECK_THROWS_AS(fd::check_trusted(fd.get(), f.string(), Trust::secret), fd::Error);
    CHECK(refusal(f, Trust::secret).empty());
    try {
        fd::check_trusted_path((d.path / "missing").string(), Trust::owned);
        FAIL("a missing path passed");
    } catch (const fd::Error & e) {
        CHECK(e.code() == Errc::not_found);
    }
}

}  // TEST_SUITE
