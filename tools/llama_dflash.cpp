// llama.cpp's own DFlash speculative decoding (and its plain decoding) on pre-tokenized prompts,
// for comparison with lucepy on the same target and draft GGUFs. Built against an existing
// llama.cpp build by tools/build_llama_dflash.sh; run with --help for the arguments.
//
// The schedule is llama-server's and lucepy's: prefill the whole prompt, take the first token from
// its last logits, then decode (one token per step, or one drafted block per verify step) up to
// exactly -n tokens, greedily and without stopping at end-of-generation tokens. The speculative
// side is driven through common/speculative.h as examples/speculative-simple drives it upstream:
// the DFlash implementation itself turns on the target's layer-input capture and injects the
// captured features into the draft's KV cache from common_speculative_process.

#include "common.h"
#include "gguf.h"
#include "llama.h"
#include "log.h"
#include "speculative.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using clock_type = std::chrono::steady_clock;

struct Args {
    std::string target, draft, prompts, out;
    std::string mode = "dflash";
    std::string flash_attn = "on";
    int n = 256;
    int ngl = 99;
    int draft_max = -1;  // -1: the draft's trained block size minus the anchor
    int threads = (int) std::thread::hardware_concurrency();
    int ctx = 0;  // 0: longest prompt + n + a block
    bool warmup = true;
    bool verbose = false;
};

struct Result {
    std::vector<llama_token> tokens;
    double prefill_s = 0, decode_s = 0;
    int steps = 0, drafted = 0, accepted = 0;
    std::vector<int> histogram;  // [j]: verify steps that accepted j drafts
};

static const char * USAGE =
    "usage: llama-dflash -m TARGET [-md DRAFT] --prompts FILE.json [-n 256] [--mode ar|dflash]\n"
    "       [--draft-max N] [-ngl 99] [-t THREADS] [-c CTX] [-fa on|off|auto] [--no-warmup]\n"
    "       [--out FILE.json] [-v]\n"
    "FILE.json is a list of prompts, each a list of token ids (already templated).\n";

[[noreturn]] static void fail(const std::string & msg) {
    fprintf(stderr, "llama-dflash: %s\n", msg.c_str());
    exit(1);
}

static Args parse_args(int argc, char ** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) fail(k + " needs a value\n" + USAGE);
            return argv[++i];
        };
        if (k == "-m") a.target = val();
        else if (k == "-md") a.draft = val();
        else if (k == "--prompts") a.prompts = val();
        else if (k == "--out") a.out = val();
        else if (k == "--mode") a.mode = val();
        else if (k == "-fa") a.flash_attn = val();
        else if (k == "-n") a.n = std::stoi(val());
        else if (k == "-ngl") a.ngl = std::stoi(val());
        else if (k == "--draft-max") a.draft_max = std::stoi(val());
        else if (k == "-t") a.threads = std::stoi(val());
        else if (k == "-c") a.ctx = std::stoi(val());
        else if (k == "--no-warmup") a.warmup = false;
        else if (k == "-v") a.verbose = true;
        else if (k == "-h" || k == "--help") { fputs(USAGE, stdout); exit(0); }
        else fail("unknown argument " + k + "\n" + USAGE);
    }
    if (a.target.empty() || a.prompts.empty()) fail(std::string("-m and --prompts are required\n") + USAGE);
    if (a.mode != "ar" && a.mode != "dflash") fail("--mode is ar or dflash, not " + a.mode);
    if (a.mode == "dflash" && a.draft.empty()) fail("--mode dflash needs the draft: -md DRAFT.gguf");
    if (a.n < 1) fail("-n must be at least 1");
    return a;
}

// A JSON list of lists of non-negative integers; anything else is refused.
static std::vector<llama_tokens> read_prompts(const std::string & path) {
    std::ifstream f(path);
    if (!f) fail("cannot read the prompts file " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string s = ss.str();
    std::vector<llama_tokens> prompts;
    int depth = 0;
    for (size_t i = 0; i < s.size(); ++i) {
        const char c = s[i];
        if (c == '[') {
            if (++depth > 2) fail(path + ": prompts nest deeper than a list of lists");
            if (depth == 2) prompts.emplace_back();
        } else if (c == ']') {
            --depth;
        } else if (c >= '0' && c <= '9' && depth == 2) {
            size_t end = i;
            prompts.back().push_back((llama_token) std::stol(s.substr(i), &end));
            i += end - 1;
        } else if (c != ',' && !isspace((unsigned char) c)) {
            fail(path + ": expected a list of lists of token ids, found '" + std::string(1, c) + "'");
        }
    }
    if (prompts.empty()) fail(path + " holds no prompts");
    for (const auto & p : prompts) if (p.empty()) fail(path + " holds an empty prompt");
    return prompts;
}

// dflash.block_size of the draft, read before any context exists: the target context's rollback
// depth (n_rs_seq) and output count are sized from the draft length.
static int draft_block_size(const std::string & path) {
    gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path.c_str(), params);
    if (!g) fail("cannot read the draft GGUF " + path);
    const int64_t k = gguf_find_key(g, "dflash.block_size");
    int block = 16;  // what llama.cpp assumes when the key is absent
    if (k >= 0) {
        const bool i32 = gguf_get_kv_type(g, k) == GGUF_TYPE_INT32;
        block = i32 ? gguf_get_val_i32(g, k) : (int) gguf_get_val_u32(g, k);
    }
    gguf_free(g);
    return block;
}

static llama_token argmax(llama_context * ctx, int i) {
    const float * row = llama_get_logits_ith(ctx, i);
    if (!row) fail("no logits for batch row " + std::to_string(i));
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    return (llama_token) (std::max_element(row, row + n_vocab) - row);
}

static double seconds_since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// The target (and, in dflash mode, the draft and llama.cpp's speculator) for the whole run.
struct Runner {
    common_init_result_ptr init;                     // owns the target model and context
    common_speculative_init_result_ptr draft_init;  // owns the draft model and context
    llama_context * tgt = nullptr;
    llama_context * dft = nullptr;  // null in ar mode
    common_speculative * spec = nullptr;
    int n_max = 0;  // drafts per verify step
    common_batch batch;

    Runner(common_params & params, const Args & a) {
        init = common_init_from_params(params);
        tgt = init->context();
        if (!tgt) fail("cannot load the target " + a.target + " (run with -v for llama.cpp's reason)");
        batch = common_batch(tgt);
        if (a.mode == "ar") return;
        common_params draft_params = common_base_params_to_speculative(params);
        draft_init = common_speculative_init_from_params(draft_params, init->model(), tgt);
        dft = draft_init->context();
        if (!dft) fail("cannot load the draft " + a.draft + " (run with -v for llama.cpp's reason)");
        if (llama_vocab_mask(llama_model_get_vocab(draft_init->model())) == LLAMA_TOKEN_NULL) {
            fail(a.draft + " has no tokenizer.ggml.mask_token_id: llama.cpp fills the noise block with it");
        }
        params.speculative.draft.ctx_tgt = tgt;
        params.speculative.draft.ctx_dft = dft;
        spec = common_speculative_init(params.speculative, 1);
        if (!spec) fail("llama.cpp made no DFlash speculator from " + a.draft);
        n_max = common_speculative_n_max(spec);
    }

    ~Runner() { common_speculative_free(spec); }  // before the contexts it points at

    void decode(llama_context * ctx) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get()) != 0) fail("llama_process failed");
    }

    // KV caches empty, the prompt in, its features in the draft; returns the first token.
    llama_token prefill(const llama_tokens & prompt) {
        llama_memory_clear(llama_get_memory(tgt), true);
        if (dft) llama_memory_clear(llama_get_memory(dft), true);
        batch.clear();
        for (size_t i = 0; i < prompt.size(); ++i) {
            batch.add(prompt[i], (llama_pos) i, 0, i + 1 == prompt.size());
        }
        decode(tgt);
        if (spec) {
            if (!common_speculative_process(spec, batch)) fail("the draft refused the prompt's features");
            common_speculative_begin(spec, 0, prompt);
        }
        return argmax(tgt, (int) prompt.size() - 1);
    }

    Result run(const llama_tokens & prompt, int n) {
        Result r;
        auto t0 = clock_type::now();
        r.tokens.push_back(prefill(prompt));
        llama_synchronize(tgt);
        if (dft) llama_synchronize(dft);
        r.prefill_s = seconds_since(t0);
        r.histogram.assign(n_max + 1, 0);
        t0 = clock_type::now();
        llama_tokens history = prompt;  // what the target holds, the last token not yet
        while ((int) r.tokens.size() < n) step(r, history, n);
        r.decode_s = seconds_since(t0);
        return r;
    }

    // One target pass: [last] alone, or [last, d_1..d_k] with k drafts; greedy acceptance keeps
    // the longest prefix with d_{i+1} == argmax(row i), then the bonus argmax(row j).
    void step(Result & r, llama_tokens & history, int n) {
        const llama_token last = r.tokens.back();
        const llama_pos pos = (llama_pos) history.size();
        llama_tokens draft;
        if (spec) {
            common_speculative_get_draft_params(spec, 0) = { true, n_max, pos, last, &history, &draft };
            common_speculative_draft(spec);
            llama_memory_seq_rm(llama_get_memory(dft), 0, pos, -1);  // the noise block's cells
        }
        batch.clear();
        batch.add(last, pos, 0, true);
        for (size_t i = 0; i < draft.size(); ++i) batch.add(draft[i], pos + 1 + (llama_pos) i, 0, true);
        decode(tgt);
        if (spec && !common_speculative_process(spec, batch)) fail("the draft refused the block's features");
        size_t j = 0;
        while (j < draft.size() && argmax(tgt, (int) j) == draft[j]) ++j;
        const llama_token bonus = argmax(tgt, (int) j);
        if (spec) common_speculative_accept(spec, 0, (uint16_t) j);
        r.steps += 1;
        r.drafted += (int) draft.size();
        r.accepted += (int) j;
        r.histogram[j] += 1;
        history.push_back(last);
        history.insert(history.end(), draft.begin(), draft.begin() + j);
        for (size_t i = 0; i < j && (int) r.tokens.size() < n; ++i) r.tokens.push_back(draft[i]);
        if ((int) r.tokens.size() < n) r.tokens.push_back(bonus);
        // drop the rejected drafts' cells (and, for a recurrent target, roll its state back)
        llama_memory_seq_rm(llama_get_memory(tgt), 0, (llama_pos) history.size(), -1);
        if (dft) llama_memory_seq_rm(llama_get_memory(dft), 0, (llama_pos) history.size(), -1);
    }
};

static enum llama_flash_attn_type flash_attn_type(const std::string & s) {
    if (s == "on" || s == "1") return LLAMA_FLASH_ATTN_TYPE_ENABLED;
    if (s == "off" || s == "0") return LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (s == "auto") return LLAMA_FLASH_ATTN_TYPE_AUTO;
    fail("-fa is on, off or auto, not " + s);
}

// The target's parameters, with the speculative ones that size its context (rollback depth,
// outputs per verify pass) when a draft runs.
static common_params target_params(const Args & a, int n_ctx, int n_batch, int n_max) {
    common_params p;
    p.model.path = a.target;
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_gpu_layers = a.ngl;
    p.fit_params = false;  // take -ngl and -c as given
    p.flash_attn_type = flash_attn_type(a.flash_attn);
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = a.threads;
    p.warmup = a.warmup;
    if (a.mode == "dflash") {
        p.speculative.types = { COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH };
        p.speculative.draft.mparams.path = a.draft;
        p.speculative.draft.n_max = n_max;
        p.speculative.draft.n_gpu_layers = a.ngl;
        const auto limits = common_speculative_get_output_limits(p.n_batch, p.n_parallel, n_max);
        p.n_outputs_max = limits.total;
        p.n_outputs_max_per_seq = limits.per_seq;
    }
    return p;
}

static std::string json_list(const std::vector<int> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
}

static std::string to_json(const Args & a, int n_max, const std::vector<Result> & results) {
    std::vector<double> rates;
    long steps = 0, drafted = 0, accepted = 0;
    std::ostringstream o;
    o.precision(6);
    o << "{\n  \"mode\": \"" << a.mode << "\", \"n\": " << a.n << ", \"n_max\": " << n_max
      << ", \"threads\": " << a.threads << ", \"ngl\": " << a.ngl << ",\n  \"prompts\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
        const Result & r = results[i];
        // the first token comes from the prefill: the decode phase makes the other n - 1
        const double rate = r.decode_s > 0 ? (r.tokens.size() - 1) / r.decode_s : 0.0;
        rates.push_back(rate);
        steps += r.steps, drafted += r.drafted, accepted += r.accepted;
        o << "    {\"prefill_s\": " << r.prefill_s << ", \"decode_s\": " << r.decode_s
          << ", \"decode_tok_s\": " << rate << ", \"steps\": " << r.steps << ", \"drafted\": " << r.drafted
          << ", \"accepted\": " << r.accepted << ", \"histogram\": " << json_list(r.histogram)
          << ",\n     \"tokens\": " << json_list(std::vector<int>(r.tokens.begin(), r.tokens.end()))
          << "}" << (i + 1 < results.size() ? "," : "") << "\n";
    }
    std::sort(rates.begin(), rates.end());
    const size_t m = rates.size();
    const double median = m % 2 ? rates[m / 2] : (rates[m / 2 - 1] + rates[m / 2]) / 2;
    const double tau = steps ? double(accepted + steps) / steps : 0.0;
    o << "  ],\n  \"summary\": {\"median_decode_tok_s\": " << median << ", \"tau\": " << tau
      << ", \"steps\": " << steps << ", \"drafted\": " << drafted << ", \"accepted\": " << accepted
      << "}\n}\n";
    return o.str();
}

int main(int argc, char ** argv) {
    const Args a = parse_args(argc, argv);
    const auto prompts = read_prompts(a.prompts);
    size_t longest = 0;
    for (const auto & p : prompts) longest = std::max(longest, p.size());

    common_init();
    common_log_set_verbosity_thold(a.verbose ? LOG_LEVEL_DEBUG : LOG_LEVEL_WARN);
    llama_backend_init();

    // drafts per step: the trained block less its anchor, unless --draft-max asks for fewer
    const int block = a.mode == "dflash" ? draft_block_size(a.draft) : 1;
    const int n_max = a.draft_max >= 0 ? std::min(a.draft_max, block - 1) : block - 1;
    const int n_ctx = a.ctx > 0 ? a.ctx : (int) longest + a.n + block + 16;
    const int n_batch = std::max(512, (int) longest);  // a prompt goes in as one batch
    if ((int) longest + a.n + block > n_ctx) {
        fail("-c " + std::to_string(n_ctx) + " is too small for the longest prompt, -n and a block");
    }

    common_params params = target_params(a, n_ctx, n_batch, n_max);
    Runner run(params, a);

    if (a.warmup) run.run(prompts[0], std::min(a.n, 2 * (run.n_max + 1)));  // first-use allocations
    std::vector<Result> results;
    for (const auto & p : prompts) results.push_back(run.run(p, a.n));

    const std::string json = to_json(a, run.n_max, results);
    if (a.out.empty()) {
        fputs(json.c_str(), stdout);
    } else {
        std::ofstream(a.out) << json;
    }
    return 0;
}
