#pragma once
// A small reader for GGUF v3 files holding float32 tensors.
//
// The whole file is read into memory once. The buffer is allocated as floats, so the tensor data
// (which GGUF aligns to `general.alignment`, a multiple of 4) can be viewed as real float objects
// without aliasing tricks; metadata is read from it byte by byte with memcpy.
//
// Every way a file can be unusable raises llama::load_error with a code and a message that names
// the problem and the file, so a caller (or a test) can tell a truncated download from a
// quantized model.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace llama {

enum class load_errc {
    missing_file,
    bad_magic,
    unsupported_version,
    truncated,
    bad_metadata,
    missing_key,
    unsupported_tensor_type,
    unsupported_architecture,
    missing_tensor,
    unknown_tensor,
    bad_tensor_shape,
};

class load_error : public std::runtime_error {
public:
    load_error(load_errc code, const std::string& what) : std::runtime_error(what), code_(code) {}
    [[nodiscard]] load_errc code() const noexcept { return code_; }

private:
    load_errc code_;
};

namespace gguf {

inline constexpr std::uint32_t magic = 0x46554747;  // "GGUF" read as a little-endian uint32
inline constexpr std::uint32_t supported_version = 3;
inline constexpr std::uint64_t default_alignment = 32;

enum class value_type : std::uint32_t {
    u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
    string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};

// ggml's tensor type numbers; only the names matter here, to say which unsupported type was found.
inline std::string ggml_type_name(std::uint32_t type) {
    static constexpr const char* names[] = {
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2(removed)", "Q4_3(removed)", "Q5_0", "Q5_1", "Q8_0",
        "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS",
        "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
        "BF16"};
    if (type < std::size(names)) return names[type];
    return "type " + std::to_string(type);
}

// One metadata value. Integers of every width are kept in the widest type of their signedness
// (the original type stays in `type`), so callers ask for "an integer" without caring whether
// the converter wrote u32 or i32.
struct value {
    value_type type{};
    value_type element_type{};  // for arrays
    std::variant<std::uint64_t, std::int64_t, double, bool, std::string, std::vector<value>> data;

    [[nodiscard]] bool is_integer() const {
        return std::holds_alternative<std::uint64_t>(data) || std::holds_alternative<std::int64_t>(data);
    }
    [[nodiscard]] bool is_number() const { return is_integer() || std::holds_alternative<double>(data); }
    [[nodiscard]] std::int64_t as_int() const {
        if (auto* u = std::get_if<std::uint64_t>(&data)) return static_cast<std::int64_t>(*u);
        if (auto* i = std::get_if<std::int64_t>(&data)) return *i;
        throw std::bad_variant_access();
    }
    [[nodiscard]] double as_double() const {
        if (auto* d = std::get_if<double>(&data)) return *d;
        return static_cast<double>(as_int());
    }
    [[nodiscard]] const std::string& as_string() const { return std::get<std::string>(data); }
    [[nodiscard]] const std::vector<value>& as_array() const { return std::get<std::vector<value>>(data); }
};

struct tensor_info {
    std::string name;
    std::vector<std::uint64_t> dims;  // GGUF order: dims[0] is the contiguous (fastest) one
    std::uint32_t type = 0;
    std::uint64_t offset = 0;         // relative to the start of the tensor data section
    std::span<const float> data;

    // The product of the dims; file::open has checked that it fits, for every tensor of a file.
    [[nodiscard]] std::uint64_t elements() const {
        std::uint64_t n = 1;
        for (auto d : dims) n *= d;
        return n;
    }
    [[nodiscard]] std::string shape_string() const {
        std::string s = "[";
        for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
        return s + "]";
    }
};

class file {
public:
    static file open(const std::filesystem::path& path) {
        std::ifstream in(path, std::ios::binary | std::ios::ate);
        if (!in) throw load_error(load_errc::missing_file, "cannot open model file '" + path.string() + "'");
        const auto size = static_cast<std::size_t>(in.tellg());
        file f;
        f.path_ = path.string();
        f.size_ = size;
        f.storage_.resize((size + sizeof(float) - 1) / sizeof(float));
        in.seekg(0);
        if (!in.read(reinterpret_cast<char*>(f.storage_.data()), static_cast<std::streamsize>(size)))
            throw load_error(load_errc::truncated, "could not read all of '" + path.string() + "'");
        f.parse();
        return f;
    }

    [[nodiscard]] const std::string& path() const { return path_; }
    [[nodiscard]] std::uint32_t version() const { return version_; }
    [[nodiscard]] std::uint64_t alignment() const { return alignment_; }
    [[nodiscard]] const std::map<std::string, value>& metadata() const { return metadata_; }
    [[nodiscard]] const std::vector<tensor_info>& tensors() const { return tensors_; }

    [[nodiscard]] const value* find(std::string_view key) const {
        auto it = metadata_.find(std::string(key));
        return it == metadata_.end() ? nullptr : &it->second;
    }
    [[nodiscard]] const value& get(std::string_view key) const {
        if (auto* v = find(key)) return *v;
        throw load_error(load_errc::missing_key, path_ + ": missing metadata key '" + std::string(key) + "'");
    }
    [[nodiscard]] std::string get_string(std::string_view key) const {
        const auto& v = get(key);
        if (v.type != value_type::string) throw wrong_type(key, "a string");
        return v.as_string();
    }
    [[nodiscard]] std::int64_t get_int(std::string_view key) const {
        const auto& v = get(key);
        if (!v.is_integer()) throw wrong_type(key, "an integer");
        return v.as_int();
    }
    [[nodiscard]] std::int64_t get_int(std::string_view key, std::int64_t fallback) const {
        return find(key) ? get_int(key) : fallback;
    }
    [[nodiscard]] double get_number(std::string_view key) const {
        const auto& v = get(key);
        if (!v.is_number()) throw wrong_type(key, "a number");
        return v.as_double();
    }
    [[nodiscard]] double get_number(std::string_view key, double fallback) const {
        return find(key) ? get_number(key) : fallback;
    }
    [[nodiscard]] const std::vector<value>& get_array(std::string_view key) const {
        const auto& v = get(key);
        if (v.type != value_type::array) throw wrong_type(key, "an array");
        return v.as_array();
    }

    [[nodiscard]] const tensor_info* find_tensor(std::string_view name) const {
        for (const auto& t : tensors_)
            if (t.name == name) return &t;
        return nullptr;
    }
    // The tensor `name` with exactly the dims given (GGUF order), or a load_error saying why not.
    [[nodiscard]] const tensor_info& tensor(std::string_view name, std::vector<std::uint64_t> dims) const {
        const auto* t = find_tensor(name);
        if (!t) throw load_error(load_errc::missing_tensor, path_ + ": missing tensor '" + std::string(name) + "'");
        if (t->dims != dims) {
            tensor_info want;
            want.dims = std::move(dims);
            throw load_error(load_errc::bad_tensor_shape, path_ + ": tensor '" + t->name + "' has shape " +
                                                              t->shape_string() + ", expected " + want.shape_string());
        }
        return *t;
    }

    file(file&&) noexcept = default;
    file& operator=(file&&) noexcept = default;
    file(const file&) = delete;             // tensor views point into this object's buffer
    file& operator=(const file&) = delete;

private:
    file() = default;

    load_error wrong_type(std::string_view key, const char* want) const {
        return load_error(load_errc::bad_metadata, path_ + ": metadata key '" + std::string(key) + "' is not " + want);
    }

    // ---- bounds-checked little-endian cursor over the buffer --------------------------------
    [[nodiscard]] const char* bytes() const { return reinterpret_cast<const char*>(storage_.data()); }

    void need(std::size_t n, const char* what) const {
        if (n > size_ - pos_)
            throw load_error(load_errc::truncated, path_ + ": file is truncated (ends at byte " + std::to_string(size_) +
                                                       " while reading " + what + ")");
    }
    template <class T>
    T read(const char* what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, bytes() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    std::string read_string(const char* what) {
        const auto n = read<std::uint64_t>(what);
        need(n, what);
        std::string s(bytes() + pos_, static_cast<std::size_t>(n));
        pos_ += static_cast<std::size_t>(n);
        return s;
    }

    value read_value(value_type type, const std::string& key, int depth = 0) {
        value v;
        v.type = type;
        const char* what = "a metadata value";
        switch (type) {
            case value_type::u8: v.data = std::uint64_t{read<std::uint8_t>(what)}; break;
            case value_type::u16: v.data = std::uint64_t{read<std::uint16_t>(what)}; break;
            case value_type::u32: v.data = std::uint64_t{read<std::uint32_t>(what)}; break;
            case value_type::u64: v.data = read<std::uint64_t>(what); break;
            case value_type::i8: v.data = std::int64_t{read<std::int8_t>(what)}; break;
            case value_type::i16: v.data = std::int64_t{read<std::int16_t>(what)}; break;
            case value_type::i32: v.data = std::int64_t{read<std::int32_t>(what)}; break;
            case value_type::i64: v.data = read<std::int64_t>(what); break;
            case value_type::f32: v.data = double{read<float>(what)}; break;
            case value_type::f64: v.data = read<double>(what); break;
            case value_type::boolean: v.data = read<std::uint8_t>(what) != 0; break;
            case value_type::string: v.data = read_string(what); break;
            case value_type::array: {
                // Nested arrays are legal GGUF but never used by real models; one level of
                // nesting is allowed so a corrupt file cannot recurse without bound.
                if (depth > 1) throw load_error(load_errc::bad_metadata, path_ + ": arrays nested too deeply in '" + key + "'");
                v.element_type = static_cast<value_type>(read<std::uint32_t>(what));
                const auto count = read<std::uint64_t>(what);
                // Each element takes at least one byte: a larger count can only be corruption.
                need(count, "an array");
                std::vector<value> items;
                items.reserve(static_cast<std::size_t>(count));
                for (std::uint64_t i = 0; i < count; ++i) items.push_back(read_value(v.element_type, key, depth + 1));
                v.data = std::move(items);
                break;
            }
            default:
                throw load_error(load_errc::bad_metadata, path_ + ": metadata key '" + key + "' has unknown value type " +
                                                              std::to_string(static_cast<std::uint32_t>(type)));
        }
        return v;
    }

    void parse() {
        if (size_ < 4 || read<std::uint32_t>("the magic number") != magic)
            throw load_error(load_errc::bad_magic, path_ + ": not a GGUF file (wrong magic number)");
        version_ = read<std::uint32_t>("the version");
        if (version_ != supported_version)
            throw load_error(load_errc::unsupported_version, path_ + ": unsupported GGUF version " +
                                                                 std::to_string(version_) + " (only version 3 is supported)");
        const auto tensor_count = read<std::uint64_t>("the tensor count");
        const auto kv_count = read<std::uint64_t>("the metadata count");

        for (std::uint64_t i = 0; i < kv_count; ++i) {
            auto key = read_string("a metadata key");
            const auto type = static_cast<value_type>(read<std::uint32_t>("a metadata type"));
            auto v = read_value(type, key);
            metadata_.insert_or_assign(std::move(key), std::move(v));
        }
        if (auto* a = find("general.alignment")) {
            if (!a->is_integer() || a->as_int() <= 0 || a->as_int() % 4 != 0)
                throw load_error(load_errc::bad_metadata, path_ + ": general.alignment must be a positive multiple of 4");
            alignment_ = static_cast<std::uint64_t>(a->as_int());
        }

        // find_tensor returns the first tensor of a name: a second one would be silently ignored.
        std::set<std::string> names;
        for (std::uint64_t i = 0; i < tensor_count; ++i) {
            tensor_info t;
            t.name = read_string("a tensor name");
            const auto n_dims = read<std::uint32_t>("a tensor's dimension count");
            if (n_dims == 0 || n_dims > 4)
                throw load_error(load_errc::bad_metadata, path_ + ": tensor '" + t.name + "' has " +
                                                              std::to_string(n_dims) + " dimensions");
            for (std::uint32_t d = 0; d < n_dims; ++d) t.dims.push_back(read<std::uint64_t>("a tensor's dimensions"));
            t.type = read<std::uint32_t>("a tensor's type");
            t.offset = read<std::uint64_t>("a tensor's offset");
            if (t.type != 0)
                throw load_error(load_errc::unsupported_tensor_type,
                                 path_ + ": tensor '" + t.name + "' has type " + ggml_type_name(t.type) +
                                     "; only F32 tensors are supported");
            if (!names.insert(t.name).second)
                throw load_error(load_errc::bad_metadata, path_ + ": tensor '" + t.name + "' appears more than once");
            tensors_.push_back(std::move(t));
        }

        // The checks subtract from the file size instead of adding offsets and sizes, so that no
        // corrupt value can wrap around 2^64 into a range that passes them.
        const std::uint64_t data_start = (pos_ + alignment_ - 1) / alignment_ * alignment_;
        // A file that ends within the padding before the tensor data has none of it.
        const std::uint64_t data_size = data_start < size_ ? size_ - data_start : 0;
        for (auto& t : tensors_) {
            const std::uint64_t bytes = byte_size(t);
            // GGUF places every tensor at a multiple of the alignment from data_start, itself a
            // multiple of the alignment; both are multiples of 4, so the floats are aligned too.
            if (t.offset % alignment_ != 0)
                throw load_error(load_errc::bad_metadata, path_ + ": tensor '" + t.name + "' is at offset " +
                                                              std::to_string(t.offset) + ", not a multiple of the alignment " +
                                                              std::to_string(alignment_) + " (general.alignment)");
            if (data_start > size_ || t.offset > data_size || bytes > data_size - t.offset)
                throw load_error(load_errc::truncated,
                                 path_ + ": file is truncated (tensor '" + t.name + "' needs " + std::to_string(bytes) +
                                     " bytes at offset " + std::to_string(t.offset) + " of the tensor data, " +
                                     "which starts at byte " + std::to_string(data_start) + " and has " +
                                     std::to_string(data_size) + " bytes)");
            t.data = std::span<const float>(storage_.data() + (data_start + t.offset) / sizeof(float),
                                            static_cast<std::size_t>(t.elements()));
        }
    }

    // The bytes of the tensor's data, or a load_error when its dims multiply past 64 bits (the
    // wrapped product could be small enough to pass the bounds check).
    [[nodiscard]] std::uint64_t byte_size(const tensor_info& t) const {
        std::uint64_t product = sizeof(float);
        for (auto d : t.dims) {
            if (d != 0 && product > std::numeric_limits<std::uint64_t>::max() / d)
                throw load_error(load_errc::bad_metadata, path_ + ": tensor '" + t.name + "' has shape " +
                                                              t.shape_string() + ", too large to address in 64 bits");
            product *= d;
        }
        return product;
    }

    std::string path_;
    std::vector<float> storage_;  // the file's bytes; floats so tensor data is properly typed
    std::size_t size_ = 0;
    std::size_t pos_ = 0;
    std::uint32_t version_ = 0;
    std::uint64_t alignment_ = default_alignment;
    std::map<std::string, value> metadata_;
    std::vector<tensor_info> tensors_;
};

}  // namespace gguf
}  // namespace llama
