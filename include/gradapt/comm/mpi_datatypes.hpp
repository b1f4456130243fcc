#pragma once
/// @file
/// The MPI side of `comm::mpi`'s element types: the MPI datatype and reduction operator of
/// `float`, `double`, `half` and `bfloat16` (the 16-bit types as a committed contiguous datatype
/// over `MPI_UINT16_T` with user-defined sum and max that compute in float), the process-wide
/// registry that creates them after MPI_Init and frees them at MPI_Finalize, and the conversion
/// of MPI return codes into `gradapt::error`.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"

namespace gradapt::comm::detail_mpi {

/// Reads the 16-bit pattern at byte offset `2 * i` of an MPI buffer.
inline std::uint16_t load_bits(const void* p, int i) {
  std::uint16_t b;
  std::memcpy(&b, static_cast<const unsigned char*>(p) + 2 * static_cast<std::size_t>(i), 2);
  return b;
}

/// Writes a 16-bit pattern at byte offset `2 * i` of an MPI buffer.
inline void store_bits(void* p, int i, std::uint16_t b) {
  std::memcpy(static_cast<unsigned char*>(p) + 2 * static_cast<std::size_t>(i), &b, 2);
}

/// `MPI_User_function` for 16-bit storage types: inout[i] = in[i] (+ or max) inout[i], computed
/// in float and rounded back to T (nearest, ties to even). Max returns NaN if either is NaN.
template <class T, bool IsMax>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  for (int i = 0; i < *len; ++i) {
    const float a = static_cast<float>(T::from_bits(load_bits(in, i)));
    const float b = static_cast<float>(T::from_bits(load_bits(inout, i)));
    float r;
    if constexpr (IsMax)
      r = (a != a || b != b) ? a + b : (a > b ? a : b);
    else
      r = a + b;
    store_bits(inout, i, T(r).bits);
  }
}

/// The MPI datatype and the sum and max operators of one 16-bit storage type.
struct ops16 {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL;
  MPI_Op max = MPI_OP_NULL;
};

/// Datatypes and reduction operators for `half` and `bfloat16`, created on first use after
/// MPI_Init and freed at MPI_Finalize (through a delete callback on MPI_COMM_SELF).
struct registry {
  ops16 half_ops;
  ops16 bfloat16_ops;
};

/// Text of an MPI error code, e.g. "MPI_ERR_TRUNCATE: message truncated".
inline std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING + 1] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(std::max(len, 0)));
}

/// Throws gradapt::error for an MPI return code other than MPI_SUCCESS.
inline void check(int code, std::string_view op, int rank, std::string_view fn) {
  if (code != MPI_SUCCESS)
    gradapt::detail::fail("comm::mpi ", op, " on rank ", rank, ": ", fn, " failed: ", error_text(code));
}

inline int free_registry(MPI_Comm, int, void* attr, void*) {
  auto* r = static_cast<registry*>(attr);
  for (ops16* o : {&r->half_ops, &r->bfloat16_ops}) {
    for (MPI_Op* op : {&o->sum, &o->max})
      if (*op != MPI_OP_NULL) MPI_Op_free(op);
    if (o->type != MPI_DATATYPE_NULL) MPI_Type_free(&o->type);
  }
  return MPI_SUCCESS;
}

/// Throws gradapt::error for a failure while creating the 16-bit datatypes and operators.
inline void setup_check(int code, std::string_view fn) {
  if (code != MPI_SUCCESS)
    gradapt::detail::fail(
        "comm::mpi: ", fn,
        " failed while creating the half/bfloat16 datatypes and operators: ", error_text(code));
}

/// Creates the committed datatype `name` and the sum and max operators of T.
template <class T>
void make_ops(ops16& o, const char* name) {
  setup_check(MPI_Type_contiguous(1, MPI_UINT16_T, &o.type), "MPI_Type_contiguous");
  setup_check(MPI_Type_set_name(o.type, name), "MPI_Type_set_name");
  setup_check(MPI_Type_commit(&o.type), "MPI_Type_commit");
  setup_check(MPI_Op_create(&reduce16<T, false>, 1, &o.sum), "MPI_Op_create");
  setup_check(MPI_Op_create(&reduce16<T, true>, 1, &o.max), "MPI_Op_create");
}

/// The process-wide registry, created on first use (thread-safe; one instance across
/// translation units) and freed by MPI_Finalize through an attribute on MPI_COMM_SELF.
inline registry& types() {
  static registry r;
  static const bool ready = [] {
    make_ops<half>(r.half_ops, "gradapt::half");
    make_ops<bfloat16>(r.bfloat16_ops, "gradapt::bfloat16");
    int key = MPI_KEYVAL_INVALID;
    setup_check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_registry, &key, nullptr),
                "MPI_Comm_create_keyval");
    setup_check(MPI_Comm_set_attr(MPI_COMM_SELF, key, &r), "MPI_Comm_set_attr");
    return true;
  }();
  static_cast<void>(ready);
  return r;
}

/// The datatype and operators of a 16-bit element type T.
template <class T>
const ops16& ops() {
  if constexpr (std::is_same_v<T, half>)
    return types().half_ops;
  else
    return types().bfloat16_ops;
}

/// MPI datatype of element type T.
template <class T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else
    return ops<T>().type;
}

/// MPI reduction operator of `op` on element type T.
template <class T>
MPI_Op reduction(reduce_op op) {
  const bool is_max = op == reduce_op::max;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
    return is_max ? MPI_MAX : MPI_SUM;
  else
    return is_max ? ops<T>().max : ops<T>().sum;
}

}  // namespace gradapt::comm::detail_mpi
