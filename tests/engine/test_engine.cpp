// The example Llama engine (examples/llama): GGUF reading, tokenizer, forward pass.
// Tests that need the model and texts read them from QEVICT_DATA_DIR and skip when it is absent.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../../examples/llama/generate.hpp"
#include "../../examples/llama/qevict_attention.hpp"

namespace fs = std::filesystem;

namespace {

const fs::path data_dir = QEVICT_DATA_DIR;

bool have_data() {
    if (fs::exists(data_dir / "stories260K.gguf")) return true;
    MESSAGE("skipped: no model data at '" << data_dir.string() << "' (set QEVICT_DATA_DIR)");
    return false;
}

std::string read_text(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// One model loaded for all tests in this program.
const llama::model& stories() {
    static const llama::model m = llama::model::load(data_dir / "stories260K.gguf");
    return m;
}

// The reference file holds the 200 generated tokens' text followed by one end-of-file newline.
std::string reference_greedy_text() {
    std::string text = read_text(data_dir / "stories260K-greedy-from-bos-200.txt");
    if (!text.empty() && text.back() == '\n') text.pop_back();
    return text;
}

// ---- small synthetic GGUF files -----------------------------------------------------------------
struct gguf_writer {
    std::string bytes;
    template <class T>
    void put(T v) {
        bytes.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
    void str(const std::string& s) {
        put<std::uint64_t>(s.size());
        bytes += s;
    }
    void kv_string(const std::string& key, const std::string& value) {
        str(key);
        put<std::uint32_t>(8);
        str(value);
    }
    void kv_u32(const std::string& key, std::uint32_t value) {
        str(key);
        put<std::uint32_t>(4);
        put(value);
    }
};

// A tiny but complete file: metadata of every scalar kind plus an array, one tensor of `type`.
std::string tiny_gguf(std::uint32_t magic = 0x46554747, std::uint32_t version = 3, std::uint32_t type = 0,
                      const std::string& arch = "llama") {
    gguf_writer w;
    w.put(magic);
    w.put(version);
    w.put<std::uint64_t>(1);  // tensors
    w.put<std::uint64_t>(4);  // metadata
    w.kv_string("general.architecture", arch);
    w.kv_u32("general.alignment", 32);
    w.str("test.floats");
    w.put<std::uint32_t>(9);
    w.put<std::uint32_t>(6);
    w.put<std::uint64_t>(3);
    for (float f : {1.f, 2.f, 3.f}) w.put(f);
    w.str("test.flag");
    w.put<std::uint32_t>(7);
    w.put<std::uint8_t>(1);
    w.str("x.weight");
    w.put<std::uint32_t>(2);
    w.put<std::uint64_t>(4);
    w.put<std::uint64_t>(2);
    w.put(type);
    w.put<std::uint64_t>(0);
    while (w.bytes.size() % 32) w.bytes += '\0';
    for (int i = 0; i < 8; ++i) w.put(static_cast<float>(i));
    return w.bytes;
}

// A GGUF v3 file of F32 tensors put together record by record. A tensor record's dims and offset
// are written as given, so a test can make them disagree with the data section.
struct gguf_builder {
    struct tensor_record {
        std::string name;
        std::vector<std::uint64_t> dims;
        std::uint64_t offset = 0;  // into the data section
    };
    gguf_writer metadata;
    std::uint64_t metadata_count = 0;
    std::vector<tensor_record> tensors;
    std::vector<float> data;

    void kv_u32(const std::string& key, std::uint32_t value) {
        metadata.kv_u32(key, value);
        ++metadata_count;
    }
    void kv_string(const std::string& key, const std::string& value) {
        metadata.kv_string(key, value);
        ++metadata_count;
    }
    void kv_strings(const std::string& key, const std::vector<std::string>& values) {
        metadata.str(key);
        metadata.put<std::uint32_t>(9);
        metadata.put<std::uint32_t>(8);
        metadata.put<std::uint64_t>(values.size());
        for (const auto& v : values) metadata.str(v);
        ++metadata_count;
    }
    void kv_floats(const std::string& key, const std::vector<float>& values) {
        metadata.str(key);
        metadata.put<std::uint32_t>(9);
        metadata.put<std::uint32_t>(6);
        metadata.put<std::uint64_t>(values.size());
        for (float v : values) metadata.put(v);
        ++metadata_count;
    }
    // A tensor whose values follow the data already there, at the next 32-byte boundary.
    void add_tensor(const std::string& name, const std::vector<std::uint64_t>& dims) {
        while (data.size() % 8) data.push_back(0.f);
        tensors.push_back({name, dims, data.size() * sizeof(float)});
        std::uint64_t n = 1;
        for (auto d : dims) n *= d;
        data.resize(data.size() + n, 0.01f);
    }
    [[nodiscard]] std::string bytes() const {
        gguf_writer w;
        w.put<std::uint32_t>(0x46554747);
        w.put<std::uint32_t>(3);
        w.put<std::uint64_t>(tensors.size());
        w.put(metadata_count);
        w.bytes += metadata.bytes;
        for (const auto& t : tensors) {
            w.str(t.name);
            w.put(static_cast<std::uint32_t>(t.dims.size()));
            for (auto d : t.dims) w.put(d);
            w.put<std::uint32_t>(0);  // F32
            w.put(t.offset);
        }
        while (w.bytes.size() % 32) w.bytes += '\0';
        for (float f : data) w.put(f);
        return w.bytes;
    }
};

// A file shaped like a real Llama model but small (byte-level vocabulary, one block): every key
// and tensor model::load asks for, and nothing else.
gguf_builder tiny_llama() {
    constexpr std::uint64_t dim = 8, ffn = 16, vocab = 256;
    gguf_builder b;
    b.kv_string("general.architecture", "llama");
    b.kv_u32("llama.embedding_length", dim);
    b.kv_u32("llama.block_count", 1);
    b.kv_u32("llama.attention.head_count", 2);
    b.kv_u32("llama.feed_forward_length", ffn);
    std::vector<std::string> pieces;
    for (int byte = 0; byte < 256; ++byte) {
        char piece[8];
        std::snprintf(piece, sizeof piece, "<0x%02X>", byte);
        pieces.emplace_back(piece);
    }
    b.kv_strings("tokenizer.ggml.tokens", pieces);
    b.kv_floats("tokenizer.ggml.scores", std::vector<float>(vocab, 0.f));
    b.add_tensor("token_embd.weight", {dim, vocab});
    b.add_tensor("output_norm.weight", {dim});
    for (const char* name : {"attn_norm", "ffn_norm"}) b.add_tensor(std::string("blk.0.") + name + ".weight", {dim});
    for (const char* name : {"attn_q", "attn_k", "attn_v", "attn_output"})
        b.add_tensor(std::string("blk.0.") + name + ".weight", {dim, dim});
    for (const char* name : {"ffn_gate", "ffn_up"}) b.add_tensor(std::string("blk.0.") + name + ".weight", {dim, ffn});
    b.add_tensor("blk.0.ffn_down.weight", {ffn, dim});
    return b;
}

fs::path write_temp(const std::string& name, const std::string& bytes) {
    const fs::path dir = fs::temp_directory_path() / "qevict_test_engine";
    fs::create_directories(dir);
    const fs::path p = dir / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
}

template <class F>
llama::load_error load_error_of(F&& f) {
    try {
        f();
    } catch (const llama::load_error& e) {
        MESSAGE("load_error: " << std::string(e.what()));
        return e;
    }
    FAIL("no load_error was thrown");
    return llama::load_error({}, "");
}

template <class F>
llama::load_errc error_of(F&& f) {
    return load_error_of(std::forward<F>(f)).code();
}

bool names_tensor(const llama::load_error& e, const std::string& tensor) {
    return std::string(e.what()).find("'" + tensor + "'") != std::string::npos;
}

}  // namespace

TEST_CASE("gguf: a well-formed file is read, metadata and tensor included") {
    const auto f = llama::gguf::file::open(write_temp("good.gguf", tiny_gguf()));
    CHECK(f.version() == 3);
    CHECK(f.get_string("general.architecture") == "llama");
    CHECK(f.get_int("general.alignment") == 32);
    REQUIRE(f.get_array("test.floats").size() == 3);
    CHECK(f.get_array("test.floats")[2].as_double() == 3.0);
    CHECK(std::get<bool>(f.get("test.flag").data));
    const auto& t = f.tensor("x.weight", {4, 2});
    REQUIRE(t.data.size() == 8);
    CHECK(t.data[7] == 7.f);
}

TEST_CASE("gguf: broken files give clear load errors") {
    using llama::load_errc;
    using llama::gguf::file;
    CHECK(error_of([] { (void)file::open("/nonexistent/model.gguf"); }) == load_errc::missing_file);
    CHECK(error_of([] { (void)file::open(write_temp("magic.gguf", tiny_gguf(0x12345678))); }) == load_errc::bad_magic);
    CHECK(error_of([] { (void)file::open(write_temp("v2.gguf", tiny_gguf(0x46554747, 2))); }) ==
          load_errc::unsupported_version);
    CHECK(error_of([] { (void)file::open(write_temp("f16.gguf", tiny_gguf(0x46554747, 3, /*F16*/ 1))); }) ==
          load_errc::unsupported_tensor_type);
    const std::string good = tiny_gguf();
    // Cut inside the tensor data, inside the tensor infos, and inside the metadata.
    for (std::size_t keep : {good.size() - 4, std::size_t{200}, std::size_t{40}, std::size_t{6}}) {
        CAPTURE(keep);
        CHECK(error_of([&] { (void)file::open(write_temp("cut.gguf", good.substr(0, keep))); }) == load_errc::truncated);
    }
    CHECK(error_of([] { (void)file::open(write_temp("empty.gguf", "")); }) == load_errc::bad_magic);
    CHECK(error_of([] { (void)file::open(write_temp("good.gguf", tiny_gguf())).tensor("y.weight", {4, 2}); }) ==
          load_errc::missing_tensor);
    CHECK(error_of([] { (void)file::open(write_temp("good.gguf", tiny_gguf())).tensor("x.weight", {2, 4}); }) ==
          load_errc::bad_tensor_shape);
}

TEST_CASE("gguf: a tensor offset that wraps around past the end of the file is refused") {
    // With one tensor record the data section starts at byte 64, so offsets of 2^64 - 64 and
    // 2^64 - 32 (multiples of the alignment, 32) would wrap the tensor's start around to the magic
    // number and to the tensor record.
    for (std::uint64_t offset : {std::uint64_t{0} - 64, std::uint64_t{0} - 32}) {
        CAPTURE(offset);
        gguf_builder b;
        b.tensors.push_back({"x.weight", {4}, offset});
        b.data.assign(4, 1.f);
        const auto bytes = b.bytes();
        REQUIRE(bytes.size() == 64 + 4 * sizeof(float));
        const auto e = load_error_of([&] { (void)llama::gguf::file::open(write_temp("wrap.gguf", bytes)); });
        CHECK(e.code() == llama::load_errc::truncated);
        CHECK(names_tensor(e, "x.weight"));
    }
}

TEST_CASE("gguf: tensor dims whose element count or byte size overflows 64 bits are refused") {
    using dims = std::vector<std::uint64_t>;
    // (2^62 + 1) * 4 bytes wraps to 4 bytes; 2^32 * 2^32 elements wraps to none; 2^31 * 2^31 * 4
    // bytes wraps to 0 bytes.
    for (const auto& shape : {dims{(std::uint64_t{1} << 62) + 1, 1}, dims{std::uint64_t{1} << 32, std::uint64_t{1} << 32},
                              dims{std::uint64_t{1} << 31, std::uint64_t{1} << 31}}) {
        CAPTURE(shape.front());
        gguf_builder b;
        b.tensors.push_back({"x.weight", shape, 0});
        b.data.assign(4, 1.f);
        const auto e = load_error_of([&] { (void)llama::gguf::file::open(write_temp("huge.gguf", b.bytes())); });
        CHECK(e.code() == llama::load_errc::bad_metadata);
        CHECK(names_tensor(e, "x.weight"));
    }
    // Without overflow, a tensor larger than the file is a truncated file.
    gguf_builder b;
    b.tensors.push_back({"x.weight", {std::uint64_t{1} << 20, std::uint64_t{1} << 20}, 0});
    b.data.assign(4, 1.f);
    const auto e = load_error_of([&] { (void)llama::gguf::file::open(write_temp("huge.gguf", b.bytes())); });
    CHECK(e.code() == llama::load_errc::truncated);
    CHECK(names_tensor(e, "x.weight"));
}

TEST_CASE("gguf: a tensor offset that is not a multiple of the alignment is refused") {
    // The data section of this file starts at byte 64; offset 16 lies inside it but not at a
    // multiple of the default alignment (32), offset 6 not even at a float.
    for (std::uint64_t offset : {std::uint64_t{16}, std::uint64_t{6}}) {
        CAPTURE(offset);
        gguf_builder b;
        b.tensors.push_back({"x.weight", {4}, offset});
        b.data.assign(16, 1.f);
        const auto e = load_error_of([&] { (void)llama::gguf::file::open(write_temp("misaligned.gguf", b.bytes())); });
        CHECK(e.code() == llama::load_errc::bad_metadata);
        CHECK(names_tensor(e, "x.weight"));
        CHECK(std::string(e.what()).find("not a multiple of the alignment 32") != std::string::npos);
    }
    // At offset 32 the same file is read.
    gguf_builder b;
    b.tensors.push_back({"x.weight", {4}, 32});
    b.data.assign(16, 1.f);
    const auto f = llama::gguf::file::open(write_temp("aligned.gguf", b.bytes()));
    CHECK(f.tensors().size() == 1);
}

TEST_CASE("gguf: two tensors of the same name are refused") {
    gguf_builder b;
    b.add_tensor("output_norm.weight", {4});
    b.add_tensor("token_embd.weight", {4, 2});
    b.add_tensor("output_norm.weight", {4});
    const auto e = load_error_of([&] { (void)llama::gguf::file::open(write_temp("twice.gguf", b.bytes())); });
    CHECK(e.code() == llama::load_errc::bad_metadata);
    CHECK(names_tensor(e, "output_norm.weight"));
}

TEST_CASE("model: a tensor the engine does not use is refused") {
    auto b = tiny_llama();
    const auto m = llama::model::load(write_temp("tiny_llama.gguf", b.bytes()));  // complete as it is
    CHECK(m.params().vocab == 256);
    b.add_tensor("rope_freqs.weight", {4});
    const auto e = load_error_of([&] { (void)llama::model::load(write_temp("tiny_llama_extra.gguf", b.bytes())); });
    CHECK(e.code() == llama::load_errc::unknown_tensor);
    CHECK(names_tensor(e, "rope_freqs.weight"));
}

TEST_CASE("model: wrong architecture and incomplete models are refused") {
    using llama::load_errc;
    // The tiny file has no tokenizer: the architecture check must come first to be useful.
    CHECK(error_of([] { (void)llama::model::load(write_temp("gpt2.gguf", tiny_gguf(0x46554747, 3, 0, "gpt2"))); }) ==
          load_errc::unsupported_architecture);
    CHECK(error_of([] { (void)llama::model::load(write_temp("good.gguf", tiny_gguf())); }) == load_errc::missing_key);
    CHECK(error_of([] { (void)llama::model::load("/nonexistent/model.gguf"); }) == load_errc::missing_file);
}

TEST_CASE("gguf: the real model cut anywhere is reported as truncated") {
    if (!have_data()) return;
    const std::string whole = read_text(data_dir / "stories260K.gguf");
    for (std::size_t keep : {std::size_t{10}, std::size_t{100}, std::size_t{1000}, std::size_t{10000}, whole.size() / 2,
                             whole.size() - 1}) {
        CAPTURE(keep);
        CHECK(error_of([&] { (void)llama::gguf::file::open(write_temp("cut_model.gguf", whole.substr(0, keep))); }) ==
              llama::load_errc::truncated);
    }
}

TEST_CASE("model: stories260K hyperparameters come from the metadata") {
    if (!have_data()) return;
    const auto& p = stories().params();
    CHECK(p.layers == 5);
    CHECK(p.dim == 64);
    CHECK(p.q_heads == 8);
    CHECK(p.kv_heads == 4);
    CHECK(p.head_dim == 8);
    CHECK(p.ffn == 172);
    CHECK(p.vocab == 512);
    CHECK(p.rms_eps == doctest::Approx(1e-5));
    CHECK(p.rope_theta == 10000.f);
    CHECK(p.rope == llama::rope_layout::interleaved);
}

TEST_CASE("tokenizer: known pieces, byte fallback, and round trips of real text") {
    if (!have_data()) return;
    const auto& tok = stories().vocab();
    CHECK(tok.bos() == 1);
    CHECK(tok.eos() == 2);
    CHECK(tok.decode(13) == "\n");  // <0x0A>
    CHECK(tok.encode("").size() == 1);

    const auto once = tok.encode("Once upon a time");
    REQUIRE(once.size() >= 2);
    CHECK(once.front() == 1);
    CHECK(tok.decode(once) == "Once upon a time");
    CHECK(tok.piece(once[1]).rfind("\xE2\x96\x81", 0) == 0);  // first piece carries the dummy prefix

    // Characters outside the 512-piece vocabulary are spelled in bytes and come back intact.
    const std::string unicode = "caf\xC3\xA9 \xE2\x9C\x93 \xF0\x9F\x98\x80 {tab}\t~";
    CHECK(tok.decode(tok.encode(unicode)) == unicode);
    CHECK(tok.encode("\xC3\xA9", false).size() == 2);  // 'é' is a piece: '▁', 'é'
    CHECK(tok.encode("\xC3\xBC", false).size() == 3);  // 'ü' is not: '▁' + two byte tokens

    const std::string text = read_text(data_dir / "tinystories-lowercase.txt").substr(0, 200000);
    const auto ids = tok.encode(text);
    CHECK(ids.size() < text.size() * 6 / 10);  // merges happen: about 2 characters per token with 512 pieces
    CHECK(tok.decode(ids) == text);
    // Story by story too: each starts a fresh dummy prefix.
    std::size_t begin = 0, stories_checked = 0;
    while (stories_checked < 50) {
        const auto end = text.find("\n\n", begin);
        if (end == std::string::npos) break;
        const std::string story = text.substr(begin, end - begin);
        CHECK(tok.decode(tok.encode(story)) == story);
        begin = end + 2;
        ++stories_checked;
    }
    CHECK(stories_checked > 5);
}

TEST_CASE("engine: greedy generation from BOS with the dense cache equals the reference text") {
    if (!have_data()) return;
    const auto& m = stories();
    llama::dense_cache cache(m.params().attention(), 1024);
    const std::vector<llama::token_id> prompt{m.vocab().bos()};
    const auto tokens = llama::generate_greedy(m, cache, prompt, {.max_new_tokens = 200});
    CHECK(tokens.size() == 200);
    CHECK(m.vocab().decode(tokens) == reference_greedy_text());
    // The model writes canonical tokenizations: encoding the reference text gives back its tokens.
    auto encoded = m.vocab().encode(reference_greedy_text());
    REQUIRE(encoded.size() == tokens.size() + 1);
    CHECK(std::equal(tokens.begin(), tokens.end(), encoded.begin() + 1));
}

TEST_CASE("engine: the rotate-half RoPE layout does not reproduce the reference (interleaved is right)") {
    if (!have_data()) return;
    const auto& m = stories();
    auto shape = m.params().attention();
    shape.rope = llama::rope_layout::half;
    llama::dense_cache cache(shape, 1024);
    const std::vector<llama::token_id> prompt{m.vocab().bos()};
    const auto tokens = llama::generate_greedy(m, cache, prompt, {.max_new_tokens = 200});
    CHECK(m.vocab().decode(tokens) != reference_greedy_text());
}

TEST_CASE("engine: a prefill of many tokens equals decoding them one by one") {
    if (!have_data()) return;
    const auto& m = stories();
    const auto prompt = m.vocab().encode("Once upon a time, there was a little dog named Max. He liked to run.");
    llama::dense_cache batched(m.params().attention(), 1024), stepwise(m.params().attention(), 1024);
    const auto all = m.prefill(prompt, batched, /*all_logits*/ true);
    std::vector<float> last = m.prefill(std::span(prompt).first(1), stepwise);
    for (std::size_t i = 1; i < prompt.size(); ++i) last = m.decode(prompt[i], stepwise);
    const std::size_t vocab = m.params().vocab;
    REQUIRE(all.size() == prompt.size() * vocab);
    for (std::size_t i = 0; i < vocab; ++i) CHECK(all[(prompt.size() - 1) * vocab + i] == doctest::Approx(last[i]).epsilon(1e-4));
    CHECK(batched.tokens() == prompt.size());
    CHECK(batched.kv_bytes() == prompt.size() * 5 * 2 * 4 * 8 * sizeof(float));
}

TEST_CASE("engine: recorded attention probabilities are distributions over the cached tokens") {
    if (!have_data()) return;
    const auto& m = stories();
    llama::dense_cache cache(m.params().attention(), 1024);
    cache.record_probabilities(true);
    const auto prompt = m.vocab().encode("Lily saw a cat.");
    auto logits = m.prefill(prompt, cache);
    (void)m.decode(llama::argmax(logits), cache);
    for (std::size_t l = 0; l < m.params().layers; ++l) {
        const auto p = cache.probabilities(l);
        REQUIRE(p.size() == m.params().q_heads * (prompt.size() + 1));
        for (std::size_t h = 0; h < m.params().q_heads; ++h) {
            double sum = 0;
            for (std::size_t t = 0; t <= prompt.size(); ++t) sum += p[h * (prompt.size() + 1) + t];
            CHECK(sum == doctest::Approx(1.0));
        }
    }
}

// ---- the engine through qevict::cache -------------------------------------------------------------

TEST_CASE("qevict: a budget that holds everything reproduces the greedy reference text") {
    if (!have_data()) return;
    const auto& m = stories();
    const std::vector<llama::token_id> prompt{m.vocab().bos()};
    SUBCASE("budget::everything()") {
        llama::qevict_attention<> kv(m.params(), qevict::budget::everything(), 201);
        const auto tokens = llama::generate_greedy(m, kv, prompt, {.max_new_tokens = 200});
        CHECK(m.vocab().decode(tokens) == reference_greedy_text());
        CHECK(kv.cache().report().counts_total().evicted == 0);
    }
    SUBCASE("budget::fraction(1.0) of a cache sized well beyond the text") {
        // The fraction is of limits::max_tokens; with room for 1024 tokens, 200 fit in Full windows.
        llama::qevict_attention<> kv(m.params(), qevict::budget::fraction(1.0), 1024);
        const auto tokens = llama::generate_greedy(m, kv, prompt, {.max_new_tokens = 200});
        CHECK(m.vocab().decode(tokens) == reference_greedy_text());
        CHECK(kv.cache().report().counts_total().evicted == 0);
        CHECK(kv.cache().report().counts_total().quantized == 0);
    }
}

TEST_CASE("qevict: a prompt prefilled through the cache gives the dense cache's logits") {
    if (!have_data()) return;
    const auto& m = stories();
    const auto prompt = m.vocab().encode(reference_greedy_text());  // 201 tokens: many windows
    llama::dense_cache dense(m.params().attention(), 256);
    llama::qevict_attention<> kv(m.params(), qevict::budget::everything(), 256);
    const auto want = m.prefill(prompt, dense);
    const auto got = m.prefill(prompt, kv);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-3));
    CHECK(llama::argmax(got) == llama::argmax(want));

    // One decode step: the observer sees every cached token once per layer, and with nothing
    // evicted the probabilities match the dense cache's head-averaged ones.
    dense.record_probabilities(true);
    std::vector<std::vector<double>> seen(m.params().layers, std::vector<double>(prompt.size() + 1, -1.0));
    kv.set_observer([&](std::size_t layer, const qevict::attention_event& e) {
        seen[layer].at(static_cast<std::size_t>(e.token)) = e.probability;
    });
    (void)m.decode(llama::argmax(want), dense);
    (void)m.decode(llama::argmax(want), kv);
    for (std::size_t l = 0; l < m.params().layers; ++l) {
        const auto reference = dense.head_averaged_probabilities(l);
        REQUIRE(reference.size() == seen[l].size());
        for (std::size_t t = 0; t < reference.size(); ++t) CHECK(seen[l][t] == doctest::Approx(reference[t]).epsilon(1e-3));
    }
}

TEST_CASE("qevict: at a 20% budget the cache stays within its budget and mostly agrees with the full cache") {
    if (!have_data()) return;
    const auto& m = stories();
    const std::vector<llama::token_id> prompt{m.vocab().bos()};
    const std::size_t steps = 400, max_tokens = steps + 1;
    llama::dense_cache full(m.params().attention(), max_tokens);
    const auto reference = llama::generate_greedy(m, full, prompt, {.max_new_tokens = steps, .stop_at_eos = false});
    REQUIRE(reference.size() == steps);

    llama::qevict_attention<> kv(m.params(), qevict::budget::fraction(0.20), max_tokens);
    const auto logits = llama::teacher_forced_logits(m, kv, prompt, reference);
    std::size_t agree = 0;
    for (std::size_t i = 0; i < steps; ++i)
        agree += llama::argmax(std::span<const float>(logits).subspan(i * m.params().vocab, m.params().vocab)) == reference[i];
    const auto report = kv.cache().report();
    MESSAGE("teacher-forced top-1 agreement " << agree << "/" << steps << "; held " << report.used_total().total()
                                              << " B of a " << report.budget_total() << " B budget; full cache "
                                              << full.kv_bytes() << " B");
    CHECK(report.used_total().total() <= report.budget_total());
    CHECK(report.counts_total().evicted > 0);  // the budget really forced evictions
    CHECK(kv.kv_bytes() < full.kv_bytes() / 4);
    // Loose on purpose: it catches a broken integration (wrong RoPE layout, wrong head mapping:
    // agreement collapses to a few percent), not a change in the routing policy.
    CHECK(agree > steps * 3 / 4);
}
