// fd_tokenizer_bench: encode (MB/s) and decode (tokens/s) throughput of fd::tokenizer on a corpus
// of documents (a JSON list of strings, tests/bench/tokenizer_bench.js writes the mixed one),
// one thread, the same loop shapes as tokenizer_bench.js times for @lenml/tokenizers. Prints one
// JSON object: per model dir {encode_mb_s, decode_tokens_s, bytes, tokens}. Run it through
// tests/bench/run_tokenizer_bench.sh, which prints the ratios against the reference.
#include "fd/tokenizer/tokenizer.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>

int main(int argc, char ** argv) {
    CLI::App    app{"fd_tokenizer_bench: tokenizer encode/decode throughput"};
    std::string models, corpus_file;
    double      seconds_min = 1.0;
    app.add_option("--models", models, "comma-separated model dirs (tokenizer.json or tokenizer.model)")->required();
    app.add_option("--corpus", corpus_file, "JSON list of documents")->required();
    app.add_option("--seconds-min", seconds_min, "time each measurement at least this long")->capture_default_str();
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e);
    }
    const auto docs = nlohmann::json::parse(std::ifstream(corpus_file)).get<std::vector<std::string>>();
    size_t     bytes = 0;
    for (const auto & d : docs) { bytes += d.size(); }
    using clock = std::chrono::steady_clock;
    nlohmann::json out = nlohmann::json::object();
    std::stringstream ss(models);
    for (std::string dir; std::getline(ss, dir, ',');) {
        const auto tok = fd::tokenizer::load_tokenizer(dir);
        std::vector<std::vector<int32_t>> ids(docs.size());
        for (size_t i = 0; i < docs.size(); ++i) { ids[i] = tok->encode(docs[i], false); }   // warm-up
        size_t tokens = 0;
        for (const auto & v : ids) { tokens += v.size(); }
        auto   t0   = clock::now();
        int    reps = 0;
        double dt   = 0;
        do {
            for (size_t i = 0; i < docs.size(); ++i) { ids[i] = tok->encode(docs[i], false); }
            ++reps;
            dt = std::chrono::duration<double>(clock::now() - t0).count();
        } while (dt < seconds_min);
        const double encode_mb_s = double(bytes) * reps / dt / 1e6;
        size_t       sink = 0;
        t0 = clock::now();
        reps = 0;
        do {
            for (const auto & v : ids) { sink += tok->decode(v, {.skip_special_tokens = false}).size(); }
            ++reps;
            dt = std::chrono::duration<double>(clock::now() - t0).count();
        } while (dt < seconds_min);
        const std::string name = std::filesystem::path(dir).filename().string();
        out[name] = {{"encode_mb_s", encode_mb_s}, {"decode_tokens_s", double(tokens) * reps / dt}, {"bytes", bytes},
                     {"tokens", tokens}, {"kind", tok->kind()}, {"decoded_bytes_checksum", sink % 1000003}};
    }
    std::cout << out.dump() << std::endl;
    return 0;
}
