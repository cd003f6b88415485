#include "http_message.h"

#include <algorithm>
#include <cctype>
#include <strings.h>

namespace fd::api {

bool CaseInsensitiveLess::operator()(const std::string & a, const std::string & b) const {
    return ::strcasecmp(a.c_str(), b.c_str()) < 0;
}

std::string Request::get_header_value(const std::string & name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
}

std::string Request::get_param_value(const std::string & key) const {
    auto it = params.find(key);
    return it == params.end() ? std::string() : it->second;
}

void Response::set_content(std::string content, const std::string & content_type) {
    body = std::move(content);
    set_header("Content-Type", content_type);
}

void Response::set_header(const std::string & name, const std::string & value) {
    for (auto & [k, v] : headers) {
        if (::strcasecmp(k.c_str(), name.c_str()) == 0) {
            v = value;
            return;
        }
    }
    headers.emplace_back(name, value);
}

std::string Response::get_header_value(const std::string & name) const {
    for (const auto & [k, v] : headers) {
        if (::strcasecmp(k.c_str(), name.c_str()) == 0) { return v; }
    }
    return {};
}

std::string url_decode(const std::string & s, bool plus_is_space) {
    auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') { return c - '0'; }
        if (c >= 'a' && c <= 'f') { return c - 'a' + 10; }
        if (c >= 'A' && c <= 'F') { return c - 'A' + 10; }
        return -1;
    };
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
            out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
            i += 2;
        } else if (s[i] == '+' && plus_is_space) {
            out += ' ';
        } else {
            out += s[i];
        }
    }
    return out;
}

std::multimap<std::string, std::string> parse_query(const std::string & query) {
    std::multimap<std::string, std::string> out;
    size_t pos = 0;
    while (pos <= query.size()) {
        size_t amp = query.find('&', pos);
        if (amp == std::string::npos) { amp = query.size(); }
        const std::string item = query.substr(pos, amp - pos);
        if (!item.empty()) {
            const size_t eq = item.find('=');
            if (eq == std::string::npos) {
                out.emplace(url_decode(item, true), "");
            } else {
                out.emplace(url_decode(item.substr(0, eq), true), url_decode(item.substr(eq + 1), true));
            }
        }
        pos = amp + 1;
    }
    return out;
}

}  // namespace fd::api
