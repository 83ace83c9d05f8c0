// llama.cpp's own greedy decode loop, timed from C++, for benchmarks/bench_peers.py.
//
// The model and context are made once; then each line read from stdin is one request and each
// answer is one JSON line on stdout, so a benchmark keeps one process and times prompt by prompt.
//
//   request:  N ID ID ID ...      (N new tokens at most, then the prompt's token ids)
//   answer:   {"prompt_tokens": P, "ttft_s": ..., "seconds": ..., "decode_tokens_per_s": ...,
//              "token_ids": [...]}
//
// The prompt is decoded in batches of --n-batch tokens (one batch for prompts up to 512 tokens),
// then one token per llama_decode, each the argmax of the last logits (llama.cpp's greedy
// sampler). A token in --eos ends the answer and is part of it. The context's settings are those
// llama-cpp-python's `Llama` uses by default (n_ctx 2048, batch 512, flash attention off), so
// the two rows differ only by the loop that drives llama.cpp.
//
//   scripts/build_llama_decode.sh    # builds .llama/build/llama_decode
//   echo "16 1 9690 198" | .llama/build/llama_decode --model M.gguf --threads 2

#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Options {
    std::string model;
    int threads = 1;
    int n_ctx = 2048;
    int n_batch = 512;
    std::set<llama_token> eos;
};

struct Answer {
    std::vector<llama_token> ids;
    double ttft_s = 0.0;     // request start -> first new token sampled
    double seconds = 0.0;    // request start -> last new token sampled
};

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string & msg) {
    std::fprintf(stderr, "llama_decode: %s\n", msg.c_str());
    std::exit(2);
}

std::set<llama_token> parse_ids(const std::string & csv) {
    std::set<llama_token> out;
    std::stringstream ss(csv);
    for (std::string item; std::getline(ss, item, ',');) {
        if (!item.empty()) out.insert(std::stoi(item));
    }
    return out;
}

Options parse_args(int argc, char ** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (i + 1 >= argc) fail("missing value after " + a);
        std::string v = argv[++i];
        if (a == "--model") o.model = v;
        else if (a == "--threads") o.threads = std::stoi(v);
        else if (a == "--n-ctx") o.n_ctx = std::stoi(v);
        else if (a == "--n-batch") o.n_batch = std::stoi(v);
        else if (a == "--eos") o.eos = parse_ids(v);
        else fail("unknown option " + a);
    }
    if (o.model.empty()) fail("--model is required");
    return o;
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);  // stdout carries only answers
}

double since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

void decode(llama_context * ctx, llama_token * ids, int n) {
    if (llama_decode(ctx, llama_batch_get_one(ids, n)) != 0) fail("llama_decode failed");
}

Answer generate(llama_context * ctx, llama_sampler * greedy, const Options & o,
                std::vector<llama_token> prompt, int max_new) {
    llama_memory_clear(llama_get_memory(ctx), true);
    Answer ans;
    auto t0 = Clock::now();
    for (size_t i = 0; i < prompt.size(); i += o.n_batch) {
        int n = (int) std::min(prompt.size() - i, (size_t) o.n_batch);
        decode(ctx, prompt.data() + i, n);
    }
    while ((int) ans.ids.size() < max_new) {
        llama_token t = llama_sampler_sample(greedy, ctx, -1);
        ans.ids.push_back(t);
        if (ans.ids.size() == 1) ans.ttft_s = since(t0);
        if (o.eos.count(t) || (int) ans.ids.size() >= max_new) break;
        decode(ctx, &t, 1);
    }
    ans.seconds = since(t0);
    return ans;
}

void print_answer(const Answer & a, size_t prompt_tokens) {
    double decode_s = a.seconds - a.ttft_s;
    double rate = a.ids.size() > 1 && decode_s > 0 ? (a.ids.size() - 1) / decode_s : 0.0;
    std::printf("{\"prompt_tokens\": %zu, \"ttft_s\": %.6f, \"seconds\": %.6f, "
                "\"decode_tokens_per_s\": %.3f, \"token_ids\": [",
                prompt_tokens, a.ttft_s, a.seconds, rate);
    for (size_t i = 0; i < a.ids.size(); ++i) std::printf(i ? ", %d" : "%d", a.ids[i]);
    std::printf("]}\n");
    std::fflush(stdout);
}

bool read_request(int & max_new, std::vector<llama_token> & prompt) {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::stringstream ss(line);
        if (!(ss >> max_new)) continue;  // blank line
        if (max_new < 1) fail("N, the most new tokens, must be at least 1");
        prompt.clear();
        for (llama_token t; ss >> t;) prompt.push_back(t);
        if (!ss.eof()) fail("a request is N then token ids, separated by spaces");
        if (prompt.empty()) fail("a request needs at least one prompt token");
        return true;
    }
    return false;
}

}  // namespace

int main(int argc, char ** argv) {
    Options o = parse_args(argc, argv);
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(o.model.c_str(), mp);
    if (!model) fail("cannot load " + o.model);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = o.n_ctx;
    cp.n_batch = o.n_batch;
    cp.n_ubatch = o.n_batch;
    cp.n_threads = o.threads;
    cp.n_threads_batch = o.threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) fail("cannot create a context");
    llama_sampler * greedy = llama_sampler_init_greedy();

    int max_new = 0;
    std::vector<llama_token> prompt;
    while (read_request(max_new, prompt)) {
        if (prompt.size() + max_new > (size_t) o.n_ctx) fail("prompt and answer exceed --n-ctx");
        print_answer(generate(ctx, greedy, o, prompt, max_new), prompt.size());
    }
    llama_sampler_free(greedy);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
