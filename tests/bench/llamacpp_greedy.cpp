// Greedy continuation by llama.cpp of a prompt of token ids, for the issue 28 conversion check
// (tests/bench/llamacpp_peer.py check). Built by tests/bench/llamacpp_peer.sh against the peer's
// libllama (llama.cpp v0.4.0); not part of fdrollout's build.
//
//   llamacpp_greedy MODEL.gguf STEPS ID [ID...]
//
// Decodes the prompt in one batch, then STEPS tokens one at a time, each the argmax of the f32
// logits llama.cpp returns (lowest id on ties), on one thread, F16 KV (llama.cpp's default).
// Prints one JSON object: {"tokens": [STEPS ids], "logprobs": [log-softmax of each chosen id]}.
// Errors (unloadable model, decode failure, bad arguments): a message on stderr, exit status 1.
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf STEPS ID [ID...]\n", argv[0]);
        return 1;
    }
    const int steps = std::atoi(argv[2]);
    std::vector<llama_token> prompt;
    for (int i = 3; i < argc; ++i) { prompt.push_back(static_cast<llama_token>(std::atoi(argv[i]))); }
    llama_backend_init();
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        std::fprintf(stderr, "llamacpp_greedy: cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(prompt.size() + steps + 16);
    cp.n_batch = static_cast<uint32_t>(prompt.size());
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        std::fprintf(stderr, "llamacpp_greedy: cannot create a context\n");
        return 1;
    }
    std::vector<llama_token> out;
    std::vector<double> lps;
    llama_batch batch = llama_batch_get_one(prompt.data(), static_cast<int32_t>(prompt.size()));
    llama_token next = 0;
    for (int s = 0; s < steps; ++s) {
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llamacpp_greedy: llama_decode failed at step %d\n", s);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        double mx = logits[0];
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > mx) { mx = logits[v]; best = v; }
        }
        double sum = 0;
        for (int v = 0; v < n_vocab; ++v) { sum += std::exp(static_cast<double>(logits[v]) - mx); }
        out.push_back(best);
        lps.push_back(-std::log(sum));
        next = best;
        batch = llama_batch_get_one(&next, 1);
    }
    std::printf("{\"tokens\": [");
    for (size_t i = 0; i < out.size(); ++i) { std::printf("%s%d", i ? ", " : "", out[i]); }
    std::printf("], \"logprobs\": [");
    for (size_t i = 0; i < lps.size(); ++i) { std::printf("%s%.6f", i ? ", " : "", lps[i]); }
    std::printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
