#include "regex.h"

#include "fd/status.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace fd::tokenizer {

namespace {

/// Per-thread match data (one ovector pair: only the whole match is read) and JIT stack.
struct ThreadState {
    pcre2_match_data *    md    = nullptr;
    pcre2_match_context * mctx  = nullptr;
    pcre2_jit_stack *     stack = nullptr;
    ThreadState() {
        md    = pcre2_match_data_create(1, nullptr);
        mctx  = pcre2_match_context_create(nullptr);
        stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
        if (mctx && stack) { pcre2_jit_stack_assign(mctx, nullptr, stack); }
    }
    ~ThreadState() {
        pcre2_match_data_free(md);
        pcre2_match_context_free(mctx);
        pcre2_jit_stack_free(stack);
    }
};

ThreadState & thread_state() {
    thread_local ThreadState st;
    return st;
}

}  // namespace

Regex::Regex(const std::string & pattern, const std::string & where) {
    int        err    = 0;
    PCRE2_SIZE offset = 0;
    auto *     code   = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                      PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        fail(Errc::invalid_checkpoint, "{}: regex error at offset {}: {}", where, size_t(offset),
             reinterpret_cast<const char *>(msg));
    }
    jit_  = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code *>(code_)); }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>> & out) const {
    auto *       code = static_cast<pcre2_code *>(code_);
    ThreadState & st  = thread_state();
    const auto * subj = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t       pos  = 0;
    while (pos <= text.size()) {
        int rc = pcre2_match(code, subj, text.size(), pos, PCRE2_NO_UTF_CHECK, st.md, st.mctx);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
            rc = pcre2_match(code, subj, text.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, st.md, st.mctx);
        }
        if (rc == PCRE2_ERROR_NOMATCH) { return; }
        FD_CHECK(rc >= 0, "pcre2_match failed with code {}", rc);
        const PCRE2_SIZE * ov = pcre2_get_ovector_pointer(st.md);
        const size_t       b = ov[0], e = ov[1];
        out.emplace_back(b, e);
        if (e > b) {
            pos = e;
        } else {  // empty match: step over one character
            if (e >= text.size()) { return; }
            pos = e + 1;
            while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) { ++pos; }
        }
    }
}

}  // namespace fd::tokenizer
