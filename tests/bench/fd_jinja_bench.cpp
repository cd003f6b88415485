// fd_jinja_bench: chat-template render time (ChatTemplate::render, add_generation_prompt) of a
// conversation read from a JSON file, per model dir. Prints one JSON object; the reference
// timings (python3-jinja2, @huggingface/jinja) and ratios come from tests/bench/jinja_bench.py.
//
//   fd_jinja_bench --chat CHAT.json --iters 2000 NAME=MODEL_DIR...
#include "fd/tokenizer/chat_template.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

using ojson = nlohmann::ordered_json;

int main(int argc, char ** argv) {
    std::string                                      chat_path;
    int                                              iters = 2000;
    std::vector<std::pair<std::string, std::string>> models;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--chat" && i + 1 < argc) {
            chat_path = argv[++i];
        } else if (a == "--iters" && i + 1 < argc) {
            iters = std::stoi(argv[++i]);
        } else if (a.find('=') != std::string::npos) {
            models.emplace_back(a.substr(0, a.find('=')), a.substr(a.find('=') + 1));
        } else {
            std::cerr << "usage: fd_jinja_bench --chat CHAT.json [--iters N] NAME=MODEL_DIR...\n";
            return 2;
        }
    }
    std::ifstream     in(chat_path);
    std::stringstream ss;
    ss << in.rdbuf();
    const ojson chat = ojson::parse(ss.str());
    ojson       out  = ojson::object();
    for (const auto & [name, dir] : models) {
        auto t = fd::tokenizer::ChatTemplate::load(dir);
        if (!t) {
            std::cerr << dir << ": no chat template\n";
            return 1;
        }
        fd::tokenizer::ChatRequest req;
        req.messages              = chat.at("messages");
        req.add_generation_prompt = true;
        std::string text          = t->render(req);  // warm-up
        std::vector<double> us(static_cast<size_t>(iters));
        for (auto & x : us) {
            auto b = std::chrono::steady_clock::now();
            text   = t->render(req);
            x      = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - b).count();
        }
        std::sort(us.begin(), us.end());
        out[name] = {{"p50_us", us[us.size() / 2]}, {"p90_us", us[us.size() * 9 / 10]}, {"iters", iters},
                     {"prompt_bytes", text.size()}};
    }
    std::cout << out.dump() << "\n";
    return 0;
}
