// Jinja lexer: template text → tokens, with jinja2 3.x's whitespace rules (Lexer.tokeniter) for
// trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False.
#include "jinja_ast.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace fd::tokenizer::jinja {
namespace {

class Lexer {
public:
    explicit Lexer(std::string_view source) {
        src_.reserve(source.size());
        for (size_t i = 0; i < source.size(); ++i) {  // newline_sequence "\n"
            if (source[i] == '\r') {
                src_ += '\n';
                if (i + 1 < source.size() && source[i + 1] == '\n') { ++i; }
            } else {
                src_ += source[i];
            }
        }
        if (!src_.empty() && src_.back() == '\n') { src_.pop_back(); }  // keep_trailing_newline=False
        line_starts_.push_back(0);
        for (size_t i = 0; i < src_.size(); ++i) {
            if (src_[i] == '\n') { line_starts_.push_back(i + 1); }
        }
    }

    std::vector<Token> run() {
        size_t pos           = 0;
        bool   line_starting = true;
        while (pos < src_.size()) {
            size_t p = find_tag(pos);
            if (p == std::string::npos) {
                emit_text(pos, src_.substr(pos));
                break;
            }
            const char  kind = src_[p + 1];
            const char  sign = p + 2 < src_.size() && (src_[p + 2] == '-' || src_[p + 2] == '+') ? src_[p + 2] : 0;
            std::string text = src_.substr(pos, p - pos);
            if (sign == '-') {
                rstrip_ws(text);
            } else if (sign != '+' && kind != '{') {  // lstrip_blocks: not for {{ }}
                size_t l_pos = text.rfind('\n');
                l_pos        = l_pos == std::string::npos ? 0 : l_pos + 1;
                if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
                    std::all_of(text.begin() + static_cast<long>(l_pos), text.end(), is_ws)) {
                    text.resize(l_pos);
                }
            }
            emit_text(pos, std::move(text));
            size_t q = p + 2 + (sign ? 1 : 0);
            if (kind == '#') {
                size_t e = src_.find("#}", q);
                if (e == std::string::npos) { error(p, "unterminated comment: missing '#}'"); }
                pos = end_tag(e, e > q && src_[e - 1] == '-', e > q && src_[e - 1] == '+', true);
            } else {
                push(kind == '{' ? Token::Type::var_begin : Token::Type::block_begin, p, "");
                pos = lex_tag(q, kind == '{' ? '}' : '%', p);
            }
            line_starting = pos > 0 && src_[pos - 1] == '\n';
        }
        push(Token::Type::eof, src_.size(), "");
        return std::move(out_);
    }

private:
    static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
    static void rstrip_ws(std::string & s) {
        // Python str.rstrip(): ASCII whitespace plus the Unicode spaces; the ASCII ones cover
        // every template seen in practice, the rest are checked below.
        while (!s.empty()) {
            if (is_ws(s.back())) {
                s.pop_back();
                continue;
            }
            // U+00A0 (C2 A0), U+3000 (E3 80 80), U+2000..U+200A, U+2028/9, U+202F, U+205F, U+0085, U+1680
            size_t n = 0;
            for (size_t k = 2; k <= 3 && k <= s.size(); ++k) {
                auto cps = utf8_decode(std::string_view(s).substr(s.size() - k));
                if (cps.size() == 1 && cps[0] != U'\uFFFD' && is_py_space(cps[0])) { n = k; }
            }
            if (n == 0) { break; }
            s.resize(s.size() - n);
        }
    }

    size_t find_tag(size_t pos) const {
        for (size_t p = src_.find('{', pos); p != std::string::npos; p = src_.find('{', p + 1)) {
            if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) { return p; }
        }
        return std::string::npos;
    }

    /// Position after the end marker at `e` (`%}`, `}}` or `#}` starts at e): `-` strips all
    /// following whitespace; trim_blocks drops one newline after a block or comment tag.
    size_t end_tag(size_t e, bool strip, bool plus, bool trims) {
        size_t pos = e + 2;
        if (strip) {
            while (pos < src_.size() && is_ws(src_[pos])) { ++pos; }
        } else if (trims && !plus && pos < src_.size() && src_[pos] == '\n') {
            ++pos;
        }
        return pos;
    }

    size_t lex_tag(size_t pos, char close, size_t tag_start) {
        int depth = 0;
        for (;;) {
            while (pos < src_.size() && is_ws(src_[pos])) { ++pos; }
            if (pos >= src_.size()) { error(tag_start, close == '}' ? "unexpected end of template: missing '}}'" : "unexpected end of template: missing '%}'"); }
            const char c = src_[pos];
            if (depth == 0) {
                bool sign = (c == '-' || c == '+') && pos + 2 < src_.size() + 0 && src_[pos + 1] == close && src_[pos + 2] == '}';
                if (sign || (c == close && pos + 1 < src_.size() && src_[pos + 1] == '}')) {
                    size_t e = sign ? pos + 1 : pos;
                    push(close == '}' ? Token::Type::var_end : Token::Type::block_end, pos, "");
                    return end_tag(e, sign && c == '-', sign && c == '+', close == '%');
                }
            }
            if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
                size_t b = pos;
                while (pos < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[pos])) || src_[pos] == '_')) { ++pos; }
                push(Token::Type::name, b, src_.substr(b, pos - b));
            } else if (std::isdigit(static_cast<unsigned char>(c))) {
                pos = lex_number(pos);
            } else if (c == '\'' || c == '"') {
                pos = lex_string(pos);
            } else {
                static const char * two[] = {"//", "**", "==", "!=", ">=", "<="};
                std::string         op;
                for (const char * t : two) {
                    if (src_.compare(pos, 2, t) == 0) { op = t; }
                }
                if (op.empty()) {
                    if (!std::strchr("+-/*%~[](){}><=.:|,;", c)) { error(pos, fmt::format("unexpected character '{}'", c)); }
                    op = std::string(1, c);
                }
                if (op == "(" || op == "[" || op == "{") { ++depth; }
                if (op == ")" || op == "]" || op == "}") {
                    if (depth == 0) { error(pos, fmt::format("unexpected '{}'", op)); }
                    --depth;
                }
                push(Token::Type::op, pos, op);
                pos += op.size();
            }
        }
    }

    size_t lex_number(size_t pos) {
        size_t b      = pos;
        auto   digits = [&] {
            while (pos < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[pos])) || src_[pos] == '_')) { ++pos; }
        };
        digits();
        bool is_float = false;
        bool after_dot = b > 0 && src_[b - 1] == '.';  // `x.0` is attribute 0, never a float
        if (!after_dot && pos + 1 < src_.size() && src_[pos] == '.' && std::isdigit(static_cast<unsigned char>(src_[pos + 1]))) {
            is_float = true;
            ++pos;
            digits();
        }
        if (!after_dot && pos < src_.size() && (src_[pos] == 'e' || src_[pos] == 'E')) {
            size_t e = pos + 1;
            if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) { ++e; }
            if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
                is_float = true;
                pos      = e;
                digits();
            }
        }
        std::string text;
        for (size_t k = b; k < pos; ++k) {
            if (src_[k] != '_') { text += src_[k]; }
        }
        if (is_float) {
            push(Token::Type::floating, b, text).f = std::stod(text);
        } else {
            try {
                push(Token::Type::integer, b, text).i = std::stoll(text);
            } catch (const std::out_of_range &) {
                error(b, "integer literal out of range");
            }
        }
        return pos;
    }

    size_t lex_string(size_t pos) {
        const char  q = src_[pos];
        size_t      b = pos++;
        std::string s;
        while (pos < src_.size() && src_[pos] != q) {
            char c = src_[pos++];
            if (c != '\\' || pos >= src_.size()) {
                s += c;
                continue;
            }
            char e = src_[pos++];
            switch (e) {
            case 'n': s += '\n'; break;
            case 't': s += '\t'; break;
            case 'r': s += '\r'; break;
            case '\\': s += '\\'; break;
            case '\'': s += '\''; break;
            case '"': s += '"'; break;
            case 'a': s += '\a'; break;
            case 'b': s += '\b'; break;
            case 'f': s += '\f'; break;
            case 'v': s += '\v'; break;
            case '\n': break;  // line continuation
            case 'x':
            case 'u':
            case 'U': {
                size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                if (pos + n > src_.size()) { error(pos, "truncated \\" + std::string(1, e) + " escape"); }
                char32_t cp = static_cast<char32_t>(std::stoul(src_.substr(pos, n), nullptr, 16));
                s += utf8_encode(std::u32string(1, cp));
                pos += n;
                break;
            }
            default:
                if (e >= '0' && e <= '7') {
                    unsigned v = static_cast<unsigned>(e - '0');
                    for (int k = 0; k < 2 && pos < src_.size() && src_[pos] >= '0' && src_[pos] <= '7'; ++k) { v = v * 8 + static_cast<unsigned>(src_[pos++] - '0'); }
                    s += utf8_encode(std::u32string(1, static_cast<char32_t>(v)));
                } else {  // Python keeps unknown escapes as written
                    s += '\\';
                    s += e;
                }
            }
        }
        if (pos >= src_.size()) { error(b, "unterminated string literal"); }
        push(Token::Type::string, b, std::move(s));
        return pos + 1;
    }

    Token & push(Token::Type t, size_t offset, std::string s) {
        Token tok;
        tok.type = t;
        tok.s    = std::move(s);
        locate(offset, tok.line, tok.col);
        out_.push_back(std::move(tok));
        return out_.back();
    }
    void emit_text(size_t offset, std::string text) {
        if (!text.empty()) { push(Token::Type::text, offset, std::move(text)); }
    }
    void locate(size_t offset, int & line, int & col) const {
        auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) - 1;
        line    = static_cast<int>(it - line_starts_.begin()) + 1;
        col     = static_cast<int>(offset - *it) + 1;
    }
    [[noreturn]] void error(size_t offset, const std::string & msg) const {
        int line, col;
        locate(offset, line, col);
        throw SyntaxError(msg, line, col);
    }

    std::string         src_;
    std::vector<size_t> line_starts_;
    std::vector<Token>  out_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(source).run(); }

}  // namespace fd::tokenizer::jinja
