// json_field.h — reading tokenizer.json fields with errors that name the file and the field
// path ("tokenizer.json: model.merges[17]: ..."). Private to daemon/src/tokenizer.
#pragma once

#include "fd/status.h"

#include <nlohmann/json.hpp>

#include <string>

namespace fd::tokenizer {

[[noreturn]] inline void bad_field(const std::string & file, const std::string & path, const std::string & why) {
    fail(Errc::invalid_checkpoint, "{}: {}: {}", file, path, why);
}

/// j[key] as T; a missing key gives `def`, a wrong type an error naming `path.key`.
template <class T>
T field_or(const nlohmann::json & j, const char * key, T def, const std::string & file, const std::string & path) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) { return def; }
    try {
        return it->get<T>();
    } catch (const nlohmann::json::exception &) {
        bad_field(file, path + "." + key, "has the wrong type (" + std::string(it->type_name()) + ")");
    }
}

/// j[key] that must exist and be of type T.
template <class T>
T field(const nlohmann::json & j, const char * key, const std::string & file, const std::string & path) {
    if (!j.is_object() || !j.contains(key) || j[key].is_null()) { bad_field(file, path + "." + key, "missing"); }
    return field_or<T>(j, key, T{}, file, path);
}

}  // namespace fd::tokenizer
