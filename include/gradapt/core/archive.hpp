#pragma once
/// @file
/// The state archive: the one format every gradapt state is saved in.
///
/// An archive is a byte string with named, typed fields and a checksum:
///
///     "GRADAPTA"                       8 bytes, magic
///     u32 container format (1)         the layout described here
///     u32 kind length, kind bytes      what wrote it, e.g. "gradapt.optimizer"
///     u32 kind version                 the writer's own format version
///     u64 field count
///     fields, each:
///       u32 name length, name bytes    full path, sections joined by '/'
///       u8  type                       1 u64, 2 i64, 3 f64, 4 bool, 5 string, 6 tensor
///       payload                        u64 / i64 / f64 bits: 8 bytes; bool: 1 byte (0 or 1);
///                                      string: u64 length + bytes; tensor: u8 element type
///                                      (1 float32, 2 float64, 3 float16, 4 bfloat16, 5 u64,
///                                      6 i64), u8 rank (0..8), rank × i64 extents, then the
///                                      elements (their count is the product of the extents)
///     u32 CRC32C of everything before it
///
/// Every integer and every element is little-endian whatever the host's byte order, so an
/// archive written on one machine reads on any other. The CRC32C (core/crc32c.hpp) detects
/// every single-bit and two-bit error and every burst of up to 32 bits: a reader verifies it,
/// and the magic, container format, kind and version, before it parses a field, so a damaged
/// archive is rejected whole before any state changes.
///
/// Fields are addressed by name, not position: a reader asks for "steps" or for the tensor
/// "buffer0/layer.weight" and gets its type, element type and shape checked. A tensor field is
/// a *logical* tensor (name, element type, shape), so a state saved over one layout can be
/// read back piece by piece (`names`, `tensor_info`) and re-laid out.
///
/// The state protocol built on it: a state has `void save(archive_writer&) const` and
/// `void load(archive_reader&)` (states whose buffers live in a backend's memory take the
/// backend first), plus `save()` returning one archive's bytes and `load(bytes)`. A load
/// validates every value before it changes anything: all or nothing.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradapt/core/crc32c.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"

namespace gradapt {

/// The type of an archive field.
enum class archive_field : std::uint8_t { u64 = 1, i64 = 2, f64 = 3, boolean = 4, string = 5, tensor = 6 };

/// The element type of an archive tensor field.
enum class archive_element : std::uint8_t {
  float32 = 1,
  float64 = 2,
  float16 = 3,
  bfloat16 = 4,
  u64 = 5,
  i64 = 6
};

/// The name of a field type, for messages.
constexpr std::string_view name(archive_field f) {
  return detail::enum_name(
      f, std::array<std::string_view, 6>{"u64", "i64", "f64", "bool", "string", "tensor"}, 1);
}

/// The name of an element type, for messages.
constexpr std::string_view name(archive_element e) {
  return detail::enum_name(
      e, std::array<std::string_view, 6>{"float32", "float64", "float16", "bfloat16", "u64", "i64"}, 1);
}

/// Bytes of one element of type `e`.
constexpr std::size_t size_of(archive_element e) {
  return e == archive_element::float16 || e == archive_element::bfloat16 ? 2
         : e == archive_element::float32                                 ? 4
                                                                         : 8;
}

/// The archive element type of T (float, double, half, bfloat16, std::uint64_t, std::int64_t).
template <class T>
inline constexpr archive_element archive_element_of_v =
    std::is_same_v<T, float>           ? archive_element::float32
    : std::is_same_v<T, double>        ? archive_element::float64
    : std::is_same_v<T, half>          ? archive_element::float16
    : std::is_same_v<T, bfloat16>      ? archive_element::bfloat16
    : std::is_same_v<T, std::uint64_t> ? archive_element::u64
                                       : archive_element::i64;

/// True for the element types a tensor field may hold.
template <class T>
inline constexpr bool is_archive_element_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> ||
    std::is_same_v<T, bfloat16> || std::is_same_v<T, std::uint64_t> || std::is_same_v<T, std::int64_t>;

/// What a tensor field holds: element type and shape (row-major extents).
struct archive_tensor_info {
  archive_element element = archive_element::float32;  ///< element type
  std::vector<std::int64_t> shape;                     ///< extents; empty for a scalar tensor
  std::uint64_t elements = 0;                          ///< product of the extents
};

namespace detail::archive_impl {

inline constexpr char magic[8] = {'G', 'R', 'A', 'D', 'A', 'P', 'T', 'A'};
inline constexpr std::uint32_t container_format = 1;
inline constexpr std::size_t max_rank = 8;

template <class U>
void put_le(std::vector<std::byte>& out, U v) {
  static_assert(std::is_unsigned_v<U>);
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFFu));
}

template <class U>
U get_le(const std::byte* p) {
  static_assert(std::is_unsigned_v<U>);
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(static_cast<U>(p[i]) << (8 * i));
  return v;
}

/// a + sep + b, built by appending (operator+ on a literal and a temporary raises GCC 12's
/// false -Wrestrict at -O3).
inline std::string join(std::string_view a, std::string_view sep, std::string_view b) {
  std::string out;
  out.reserve(a.size() + sep.size() + b.size());
  out.append(a).append(sep).append(b);
  return out;
}

/// The unsigned integer with T's bytes.
template <class T>
using bits_t = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                                  std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;

}  // namespace detail::archive_impl

/// Writes one archive. Fields are named paths; `begin`/`end` open and close a section (a
/// prefix joined with '/'). A name may appear once.
///
///     gradapt::archive_writer w{"gradapt.loss_scaler", 1};
///     w.put("scale", 65536.0);
///     w.put_tensor<float>("m/layer.weight", m, {rows, cols});
///     std::vector<std::byte> bytes = w.finish();
class archive_writer {
 public:
  /// Starts an archive of `kind` (non-empty, at most 255 bytes) at the writer's format `version`.
  archive_writer(std::string_view kind, std::uint32_t version) : kind_(kind), version_(version) {
    namespace ai = detail::archive_impl;
    detail::require(!kind_.empty() && kind_.size() <= 255, "archive_writer: kind '", kind_,
                    "' must have 1 to 255 characters");
    // The header goes first, its field count patched by finish(): the archive is built in
    // place and handed out without a copy.
    const auto* m = reinterpret_cast<const std::byte*>(ai::magic);
    body_.insert(body_.end(), m, m + sizeof ai::magic);
    ai::put_le(body_, ai::container_format);
    ai::put_le(body_, static_cast<std::uint32_t>(kind_.size()));
    const auto* k = reinterpret_cast<const std::byte*>(kind_.data());
    body_.insert(body_.end(), k, k + kind_.size());
    ai::put_le(body_, version_);
    count_at_ = body_.size();
    ai::put_le(body_, std::uint64_t{0});
    fields_at_ = body_.size();
  }

  /// Reserves room for `bytes` bytes of archive in all, so a writer that knows its size
  /// up front holds the archive once (no growth copies).
  void reserve(std::size_t bytes) { body_.reserve(bytes); }

  /// Bytes written so far (header and fields; finish() adds the 4-byte CRC32C).
  std::size_t size() const { return body_.size(); }

  /// The kind this archive is written as.
  std::string_view kind() const { return kind_; }

  /// Opens section `name`: later names are prefixed with "name/" until the matching `end`.
  void begin(std::string_view name) {
    check_name(name, "begin");
    prefix_.push_back(prefix_.empty() ? std::string(name)
                                      : detail::archive_impl::join(prefix_.back(), "/", name));
  }
  /// Closes the innermost section.
  void end() {
    detail::require(!prefix_.empty(), "archive_writer(", kind_, "): end() without a matching begin()");
    prefix_.pop_back();
  }

  /// Writes a scalar field: unsigned integers as u64, signed as i64, float and double as f64,
  /// bool, and anything convertible to std::string_view as a string.
  template <class T>
  void put(std::string_view name, const T& value) {
    namespace ai = detail::archive_impl;
    if constexpr (std::is_same_v<T, bool>) {
      header(name, archive_field::boolean);
      body_.push_back(static_cast<std::byte>(value ? 1 : 0));
    } else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T>) {
      header(name, archive_field::u64);
      ai::put_le(body_, static_cast<std::uint64_t>(value));
    } else if constexpr (std::is_integral_v<T>) {
      header(name, archive_field::i64);
      ai::put_le(body_, static_cast<std::uint64_t>(static_cast<std::int64_t>(value)));
    } else if constexpr (std::is_floating_point_v<T>) {
      static_assert(sizeof(T) <= sizeof(double), "archive_writer::put: long double is not an archive type");
      header(name, archive_field::f64);
      ai::put_le(body_, std::bit_cast<std::uint64_t>(static_cast<double>(value)));
    } else {
      static_assert(std::is_convertible_v<const T&, std::string_view>,
                    "archive_writer::put: a field is an integer, floating-point, bool or string value");
      const std::string_view s = value;
      header(name, archive_field::string);
      ai::put_le(body_, static_cast<std::uint64_t>(s.size()));
      const auto* p = reinterpret_cast<const std::byte*>(s.data());
      body_.insert(body_.end(), p, p + s.size());
    }
  }

  /// Writes a tensor field: `data.size()` must equal the product of `shape` (rank 0 to 8).
  template <class T>
  void put_tensor(std::string_view name, std::span<const T> data, std::span<const std::int64_t> shape) {
    namespace ai = detail::archive_impl;
    static_assert(is_archive_element_v<T>,
                  "archive_writer::put_tensor: elements are float, double, half, bfloat16, uint64 or int64");
    detail::require(shape.size() <= ai::max_rank, "archive_writer(", kind_, "): tensor '", name,
                    "' has rank ", shape.size(), " (at most ", ai::max_rank, ")");
    std::uint64_t n = 1;
    for (const std::int64_t e : shape) {
      detail::require(e >= 0, "archive_writer(", kind_, "): tensor '", name, "' has a negative extent ", e);
      n *= static_cast<std::uint64_t>(e);
    }
    detail::require(n == data.size(), "archive_writer(", kind_, "): tensor '", name, "' has ", data.size(),
                    " elements but its shape holds ", n);
    header(name, archive_field::tensor);
    body_.push_back(static_cast<std::byte>(archive_element_of_v<T>));
    body_.push_back(static_cast<std::byte>(shape.size()));
    for (const std::int64_t e : shape) ai::put_le(body_, static_cast<std::uint64_t>(e));
    if constexpr (std::endian::native == std::endian::little) {
      const auto* p = reinterpret_cast<const std::byte*>(data.data());
      body_.insert(body_.end(), p, p + data.size_bytes());
    } else {
      for (const T& v : data) {
        ai::bits_t<T> b;
        std::memcpy(&b, &v, sizeof b);
        ai::put_le(body_, b);
      }
    }
  }
  /// Writes a one-dimensional tensor field of `data.size()` elements.
  template <class T>
  void put_tensor(std::string_view name, std::span<const T> data) {
    const std::int64_t n = static_cast<std::int64_t>(data.size());
    put_tensor<T>(name, data, std::span<const std::int64_t>(&n, 1));
  }

  /// The archive's bytes: header, fields, CRC32C. The writer is left empty of fields.
  /// @throws gradapt::error when a section is still open
  std::vector<std::byte> finish() {
    namespace ai = detail::archive_impl;
    if (!prefix_.empty())
      detail::fail("archive_writer(", kind_, "): finish() with section '", prefix_.back(), "' still open");
    const auto count = static_cast<std::uint64_t>(names_.size());
    for (std::size_t i = 0; i < sizeof count; ++i)
      body_[count_at_ + i] = static_cast<std::byte>((count >> (8 * i)) & 0xFFu);
    ai::put_le(body_, crc32c(body_));
    std::vector<std::byte> out = std::move(body_);
    body_.assign(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(fields_at_));
    for (std::size_t i = 0; i < sizeof count; ++i) body_[count_at_ + i] = std::byte{0};
    names_.clear();
    return out;
  }

 private:
  void check_name(std::string_view name, const char* what) const {
    detail::require(!name.empty(), "archive_writer(", kind_, "): ", what, " with an empty name");
  }
  void header(std::string_view name, archive_field type) {
    namespace ai = detail::archive_impl;
    check_name(name, "a field");
    std::string full =
        prefix_.empty() ? std::string(name) : detail::archive_impl::join(prefix_.back(), "/", name);
    detail::require(full.size() <= 65535, "archive_writer(", kind_, "): field name '", full.substr(0, 64),
                    "...' is longer than 65535 bytes");
    detail::require(names_.insert(full).second, "archive_writer(", kind_, "): field '", full,
                    "' written twice");
    ai::put_le(body_, static_cast<std::uint32_t>(full.size()));
    const auto* p = reinterpret_cast<const std::byte*>(full.data());
    body_.insert(body_.end(), p, p + full.size());
    body_.push_back(static_cast<std::byte>(type));
  }

  std::string kind_;
  std::uint32_t version_;
  std::vector<std::string> prefix_;
  std::vector<std::byte> body_;  ///< header, then the fields
  std::size_t count_at_ = 0;     ///< where the header's field count sits
  std::size_t fields_at_ = 0;    ///< where the fields begin
  std::set<std::string, std::less<>> names_;
};

/// Reads one archive. The constructor checks the magic, the container format, the CRC32C,
/// the kind and the version, and indexes every field, before anything is read: a damaged,
/// truncated or foreign byte string throws there. Fields are then read by name (relative to
/// the open section), each with its type, element type and shape checked; `finish` throws
/// when a field was never read (an archive from a state with more parts than this one).
///
/// The reader refers to `bytes` without copying them: they must outlive it.
class archive_reader {
 public:
  /// Opens `bytes` as an archive of `kind` written at a format version from 1 to `max_version`.
  /// @throws gradapt::error naming what is wrong (not an archive, checksum, kind, version, layout)
  archive_reader(std::span<const std::byte> bytes, std::string_view kind, std::uint32_t max_version)
      : bytes_(bytes), expected_kind_(kind) {
    namespace ai = detail::archive_impl;
    const std::size_t fixed = sizeof ai::magic + 4 + 4 + 4 + 8 + 4;
    detail::require(bytes.size() >= fixed, "archive(", kind, "): ", bytes.size(),
                    " bytes are too few for an archive (truncated?)");
    detail::require(std::memcmp(bytes.data(), ai::magic, sizeof ai::magic) == 0, "archive(", kind,
                    "): not a gradapt state archive (wrong magic bytes)");
    const std::size_t body_end = bytes.size() - 4;
    const std::uint32_t stored = ai::get_le<std::uint32_t>(bytes.data() + body_end);
    const std::uint32_t actual = crc32c(bytes.first(body_end));
    detail::require(stored == actual, "archive(", kind, "): checksum mismatch (CRC32C ", actual,
                    " over the contents, ", stored, " stored): the archive is damaged or truncated");
    std::size_t at = sizeof ai::magic;
    const std::uint32_t format = ai::get_le<std::uint32_t>(bytes.data() + at);
    at += 4;
    detail::require(format == ai::container_format, "archive(", kind, "): container format ", format,
                    " (this gradapt reads format ", ai::container_format, ")");
    const std::uint32_t klen = ai::get_le<std::uint32_t>(bytes.data() + at);
    at += 4;
    detail::require(klen <= body_end - at && body_end - at - klen >= 12, "archive(", kind,
                    "): the kind's length ", klen, " runs past the end");
    kind_.assign(reinterpret_cast<const char*>(bytes.data() + at), klen);
    at += klen;
    detail::require(kind_ == kind, "archive: this is a '", kind_, "' archive, expected '", kind, "'");
    version_ = ai::get_le<std::uint32_t>(bytes.data() + at);
    at += 4;
    detail::require(version_ >= 1 && version_ <= max_version, "archive(", kind, "): format version ",
                    version_, " (this gradapt reads 1 to ", max_version, ")");
    const std::uint64_t count = ai::get_le<std::uint64_t>(bytes.data() + at);
    at += 8;
    detail::require(count <= (body_end - at) / 6, "archive(", kind_, "): ", count, " fields announced in ",
                    body_end - at, " bytes");
    fields_.reserve(static_cast<std::size_t>(count));
    for (std::uint64_t i = 0; i < count; ++i) at = index_field(at, body_end);
    detail::require(at == body_end, "archive(", kind_, "): ", body_end - at, " bytes after the last field");
    read_.assign(fields_.size(), false);
  }

  /// The kind written in the archive.
  std::string_view kind() const { return kind_; }
  /// The writer's format version (1 to the reader's max_version).
  std::uint32_t version() const { return version_; }

  /// Opens section `name`: later names are looked up under "name/" until the matching `end`.
  void begin(std::string_view name) { prefix_.push_back(full(name)); }
  /// Closes the innermost section.
  void end() {
    detail::require(!prefix_.empty(), "archive(", kind_, "): end() without a matching begin()");
    prefix_.pop_back();
  }

  /// True when field `name` exists in the open section.
  bool has(std::string_view name) const { return by_name_.count(full(name)) != 0; }

  /// The names (relative to the open section) of every field under section `section`
  /// ("" for the open section itself), in the order they were written.
  std::vector<std::string> names(std::string_view section = {}) const {
    const std::string base =
        section.empty() ? (prefix_.empty() ? std::string() : prefix_.back()) : full(section);
    const std::string lead = base.empty() ? std::string() : base + "/";
    const std::size_t strip = prefix_.empty() ? 0 : prefix_.back().size() + 1;
    std::vector<std::string> out;
    for (const auto& f : fields_)
      if (f.name.compare(0, lead.size(), lead) == 0) out.push_back(f.name.substr(strip));
    return out;
  }

  /// The type of field `name`.
  archive_field type(std::string_view name) const { return at(name).type; }

  /// Reads a scalar field as T: unsigned integers from u64, signed from i64, float and double
  /// from f64 (a float must hold the value exactly), bool, std::string, or std::string_view (a
  /// view into the archive's bytes, valid while they are: a nested archive read in place).
  /// @throws gradapt::error when the field is missing, has another type, or its value does
  ///         not fit T
  template <class T>
  T get(std::string_view name) {
    namespace ai = detail::archive_impl;
    const field& f = at(name);
    if constexpr (std::is_same_v<T, bool>) {
      expect(f, archive_field::boolean);
      const auto b = static_cast<std::uint8_t>(bytes_[f.offset]);
      mark(f);
      return b != 0;
    } else if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T>) {
      expect(f, archive_field::u64);
      const std::uint64_t v = ai::get_le<std::uint64_t>(bytes_.data() + f.offset);
      detail::require(v <= std::numeric_limits<T>::max(), "archive(", kind_, "): field '", f.name, "' is ", v,
                      ", too large for its type");
      mark(f);
      return static_cast<T>(v);
    } else if constexpr (std::is_integral_v<T>) {
      expect(f, archive_field::i64);
      const auto v = static_cast<std::int64_t>(ai::get_le<std::uint64_t>(bytes_.data() + f.offset));
      detail::require(v >= std::numeric_limits<T>::min() && v <= std::numeric_limits<T>::max(), "archive(",
                      kind_, "): field '", f.name, "' is ", v, ", out of range for its type");
      mark(f);
      return static_cast<T>(v);
    } else if constexpr (std::is_floating_point_v<T>) {
      expect(f, archive_field::f64);
      const double v = std::bit_cast<double>(ai::get_le<std::uint64_t>(bytes_.data() + f.offset));
      if constexpr (!std::is_same_v<T, double>)
        detail::require(std::isnan(v) || static_cast<double>(static_cast<T>(v)) == v, "archive(", kind_,
                        "): field '", f.name, "' is ", v, ", not exactly representable in its type");
      mark(f);
      return static_cast<T>(v);
    } else {
      static_assert(std::is_same_v<T, std::string> || std::is_same_v<T, std::string_view>,
                    "archive_reader::get: read integers, floats, bool, std::string or std::string_view");
      expect(f, archive_field::string);
      const std::uint64_t n = ai::get_le<std::uint64_t>(bytes_.data() + f.offset);
      mark(f);
      return T(reinterpret_cast<const char*>(bytes_.data() + f.offset + 8), static_cast<std::size_t>(n));
    }
  }

  /// Element type and shape of tensor field `name`.
  archive_tensor_info tensor_info(std::string_view name) const {
    const field& f = at(name);
    expect(f, archive_field::tensor);
    return f.tensor;
  }

  /// Reads tensor field `name` into `out`. The field must hold elements of type T with exactly
  /// `shape` (compared extent by extent); `out` must have that many elements.
  template <class T>
  void get_tensor(std::string_view name, std::span<T> out, std::span<const std::int64_t> shape) {
    const field& f = at(name);
    expect(f, archive_field::tensor);
    detail::require(f.tensor.element == archive_element_of_v<T>, "archive(", kind_, "): tensor '", f.name,
                    "' holds ", gradapt::name(f.tensor.element), " elements, expected ",
                    gradapt::name(archive_element_of_v<T>));
    detail::require(std::ranges::equal(f.tensor.shape, shape), "archive(", kind_, "): tensor '", f.name,
                    "' has shape ", shape_string(f.tensor.shape), ", expected ",
                    shape_string({shape.begin(), shape.end()}));
    detail::require(out.size() == f.tensor.elements, "archive_reader::get_tensor: '", f.name, "' has ",
                    f.tensor.elements, " elements but the destination ", out.size());
    copy_elements(f, out);
    mark(f);
  }
  /// Reads a one-dimensional tensor field of `out.size()` elements.
  template <class T>
  void get_tensor(std::string_view name, std::span<T> out) {
    const std::int64_t n = static_cast<std::int64_t>(out.size());
    get_tensor<T>(name, out, std::span<const std::int64_t>(&n, 1));
  }
  /// Reads tensor field `name`, whatever its shape, as a vector of T (element type checked).
  template <class T>
  std::vector<T> get_tensor(std::string_view name) {
    const archive_tensor_info info = tensor_info(name);
    std::vector<T> out(static_cast<std::size_t>(info.elements));
    get_tensor<T>(name, std::span<T>(out), info.shape);
    return out;
  }

  /// Checks that every field of the open section (of the whole archive when none is open)
  /// was read. A state's `load` calls it after reading its fields and before changing
  /// anything, so an archive written by a state with more parts is rejected whole.
  /// @throws gradapt::error naming the first field nobody read
  void finish_section() const {
    const std::string lead =
        prefix_.empty() ? std::string() : detail::archive_impl::join(prefix_.back(), "/", "");
    for (std::size_t i = 0; i < fields_.size(); ++i)
      detail::require(read_[i] || fields_[i].name.compare(0, lead.size(), lead) != 0, "archive(", kind_,
                      "): field '", fields_[i].name,
                      "' was not read (written by a state with parts this one does not have?)");
  }

  /// Checks that every section was closed and every field read.
  /// @throws gradapt::error naming the open section or the first field nobody read
  void finish() const {
    if (!prefix_.empty())
      detail::fail("archive(", kind_, "): finish() with section '", prefix_.back(), "' still open");
    finish_section();
  }

 private:
  struct field {
    std::string name;
    archive_field type;
    std::size_t offset;  ///< payload start
    archive_tensor_info tensor;
    std::size_t index;
  };

  static std::string shape_string(const std::vector<std::int64_t>& s) {
    std::string out = "[";
    for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }

  std::string full(std::string_view name) const {
    detail::require(!name.empty(), "archive(", kind_, "): a field name is empty");
    return prefix_.empty() ? std::string(name) : detail::archive_impl::join(prefix_.back(), "/", name);
  }

  const field& at(std::string_view name) const {
    const std::string n = full(name);
    const auto it = by_name_.find(n);
    detail::require(it != by_name_.end(), "archive(", kind_, "): no field '", n,
                    "' (written by another kind or version of this state?)");
    return fields_[it->second];
  }

  void expect(const field& f, archive_field t) const {
    detail::require(f.type == t, "archive(", kind_, "): field '", f.name, "' is a ", gradapt::name(f.type),
                    ", expected a ", gradapt::name(t));
  }

  void mark(const field& f) { read_[f.index] = true; }

  template <class T>
  void copy_elements(const field& f, std::span<T> out) const {
    namespace ai = detail::archive_impl;
    const std::byte* p = bytes_.data() + f.offset;
    if constexpr (std::endian::native == std::endian::little) {
      if (!out.empty()) std::memcpy(out.data(), p, out.size_bytes());
    } else {
      for (std::size_t i = 0; i < out.size(); ++i) {
        const auto b = ai::get_le<ai::bits_t<T>>(p + i * sizeof(T));
        std::memcpy(&out[i], &b, sizeof b);
      }
    }
  }

  // Indexes the field at `at`; returns the offset after it.
  std::size_t index_field(std::size_t at, std::size_t end) {
    namespace ai = detail::archive_impl;
    const auto need = [&](std::uint64_t n, const char* what) {
      detail::require(n <= end - at, "archive(", kind_, "): field ", fields_.size(), " ends inside its ",
                      what, " (", end - at, " bytes left)");
    };
    need(4, "name length");
    const std::uint32_t nlen = ai::get_le<std::uint32_t>(bytes_.data() + at);
    at += 4;
    need(nlen, "name");
    field f;
    f.name.assign(reinterpret_cast<const char*>(bytes_.data() + at), nlen);
    at += nlen;
    detail::require(!f.name.empty(), "archive(", kind_, "): field ", fields_.size(), " has an empty name");
    need(1, "type");
    const auto type = static_cast<std::uint8_t>(bytes_[at++]);
    detail::require(type >= 1 && type <= 6, "archive(", kind_, "): field '", f.name, "' has unknown type ",
                    unsigned{type});
    f.type = static_cast<archive_field>(type);
    f.offset = at;
    switch (f.type) {
      case archive_field::u64:
      case archive_field::i64:
      case archive_field::f64:
        need(8, "value");
        at += 8;
        break;
      case archive_field::boolean: {
        need(1, "value");
        const auto b = static_cast<std::uint8_t>(bytes_[at]);
        detail::require(b <= 1, "archive(", kind_, "): bool field '", f.name, "' holds ", unsigned{b});
        at += 1;
        break;
      }
      case archive_field::string: {
        need(8, "length");
        const std::uint64_t n = ai::get_le<std::uint64_t>(bytes_.data() + at);
        at += 8;
        need(n, "text");
        at += static_cast<std::size_t>(n);
        break;
      }
      case archive_field::tensor: {
        need(2, "element type and rank");
        const auto e = static_cast<std::uint8_t>(bytes_[at]);
        const auto rank = static_cast<std::uint8_t>(bytes_[at + 1]);
        at += 2;
        detail::require(e >= 1 && e <= 6, "archive(", kind_, "): tensor '", f.name,
                        "' has unknown element type ", unsigned{e});
        detail::require(rank <= ai::max_rank, "archive(", kind_, "): tensor '", f.name, "' has rank ",
                        unsigned{rank});
        f.tensor.element = static_cast<archive_element>(e);
        need(8ull * rank, "shape");
        std::uint64_t n = 1;
        const std::uint64_t cap = (end - at) / size_of(f.tensor.element);
        for (unsigned k = 0; k < rank; ++k) {
          const auto d = static_cast<std::int64_t>(ai::get_le<std::uint64_t>(bytes_.data() + at));
          at += 8;
          detail::require(d >= 0, "archive(", kind_, "): tensor '", f.name, "' has a negative extent ", d);
          f.tensor.shape.push_back(d);
          n = (d == 0 || n == 0)
                  ? 0
                  : (static_cast<std::uint64_t>(d) > cap / n ? cap + 1 : n * static_cast<std::uint64_t>(d));
        }
        f.tensor.elements = n;
        need(n * size_of(f.tensor.element), "elements");
        f.offset = at;
        at += static_cast<std::size_t>(n * size_of(f.tensor.element));
        break;
      }
    }
    f.index = fields_.size();
    detail::require(by_name_.emplace(f.name, f.index).second, "archive(", kind_, "): field '", f.name,
                    "' appears twice");
    fields_.push_back(std::move(f));
    return at;
  }

  std::span<const std::byte> bytes_;
  std::string expected_kind_;
  std::string kind_;
  std::uint32_t version_ = 0;
  std::vector<field> fields_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::vector<bool> read_;
  std::vector<std::string> prefix_;
};

/// A named scalar member of a plain state struct S, for put_fields and get_fields. A state
/// names its fields once, as a tuple: `std::tuple{archive_member{"scale", &S::scale}, ...}`.
template <class S, class M>
struct archive_member {
  std::string_view name;  ///< the field's name in the archive
  M S::*ptr;              ///< the member
};

/// `archive_member{"name", &S::member}` deduces S and the member's type.
template <class S, class M>
archive_member(std::string_view, M S::*) -> archive_member<S, M>;

/// Writes every member of `s` listed in `fields` into the open section.
template <class S, class... Ms>
void put_fields(archive_writer& w, const S& s, const std::tuple<archive_member<S, Ms>...>& fields) {
  std::apply([&](const auto&... f) { (w.put(f.name, s.*(f.ptr)), ...); }, fields);
}

/// Reads the members listed in `fields` into a value-initialised S (checks of each field's
/// type and range as in archive_reader::get; the caller validates the whole state).
template <class S, class... Ms>
S get_fields(archive_reader& r, const std::tuple<archive_member<S, Ms>...>& fields) {
  S s{};
  std::apply(
      [&](const auto&... f) {
        ((s.*(f.ptr) = r.template get<std::remove_cvref_t<decltype(s.*(f.ptr))>>(f.name)), ...);
      },
      fields);
  return s;
}

/// One archive holding `state`: `archive_writer{S::archive_kind, S::archive_version}`, then
/// `state.save(writer)`. The `save()` of every gradapt state that lives in host memory.
template <class S>
std::vector<std::byte> save_archive(const S& state) {
  archive_writer w{S::archive_kind, S::archive_version};
  state.save(w);
  return w.finish();
}

/// Loads `state` from one archive written by `save_archive`: the archive's kind must be
/// `S::archive_kind` at a version up to `S::archive_version`, and `state.load(reader)` reads
/// it whole (all or nothing).
template <class S>
void load_archive(S& state, std::span<const std::byte> bytes) {
  archive_reader r{bytes, S::archive_kind, S::archive_version};
  state.load(r);
  r.finish();
}

/// The checkpoint protocol of a policy whose whole state is one plain struct `State` that
/// lists its fields in `State::archive_fields()`. `Derived` provides `state()`, a validating
/// `restore(const State&)` and `archive_kind` / `archive_version`; this base provides the four
/// save/load members every such policy has, so they are written once.
template <class Derived, class State>
class archived_state {
 public:
  /// Writes the state's fields into the open section of `w`.
  void save(archive_writer& w) const { put_fields(w, self().state(), State::archive_fields()); }
  /// Reads what `save(archive_writer&)` wrote and restores it through `restore` (all or nothing).
  /// @throws gradapt::error for a missing, mistyped, extra or out-of-range field
  void load(archive_reader& r) {
    const State s = get_fields(r, State::archive_fields());
    r.finish_section();
    self().restore(s);
  }
  /// The state as one archive of kind `Derived::archive_kind` (core/archive.hpp).
  std::vector<std::byte> save() const { return save_archive(self()); }
  /// Restores a state from `save()`; all or nothing.
  /// @throws gradapt::error for a damaged archive, another kind, or a state that does not fit
  void load(std::span<const std::byte> bytes) { load_archive(self(), bytes); }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  Derived& self() { return static_cast<Derived&>(*this); }
};

/// `save_archive` for a state whose buffers live in `backend`'s memory (`state.save(backend, w)`).
template <class S, class B>
std::vector<std::byte> save_archive(const S& state, const B& backend) {
  archive_writer w{S::archive_kind, S::archive_version};
  state.save(backend, w);
  return w.finish();
}

/// `load_archive` for a state whose buffers live in `backend`'s memory (`state.load(backend, r)`).
template <class S, class B>
void load_archive(S& state, const B& backend, std::span<const std::byte> bytes) {
  archive_reader r{bytes, S::archive_kind, S::archive_version};
  state.load(backend, r);
  r.finish();
}

}  // namespace gradapt
