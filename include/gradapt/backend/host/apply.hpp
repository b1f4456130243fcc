#pragma once
/// @file
/// The host backend's element loops (part of gradapt::host, backend/host.hpp): `apply` and
/// the fused apply-and-sum over one tensor or a list, on `simd::pack`s for vectorizable
/// functors (AVX2 chosen at run time) and in groups of 8 otherwise, with the sums in the
/// reductions' fixed order.

#include <algorithm>
#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "gradapt/backend/host/reduce.hpp"
#include "gradapt/backend/simd.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/dtype.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/tensor_view.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gradapt::detail::host_impl {

/// Elements handled as one group by the element loops: all loads of a group happen before
/// any store, so the compiler's straight-line (SLP) vectoriser can use vector loads and stores
/// at plain -O2 without proving that outputs and inputs do not overlap.
inline constexpr std::size_t group = 8;

/// Loads `group` consecutive elements into their compute type (no value-initialisation, so
/// the array can live in registers).
template <class T>
GRADAPT_INLINE std::array<compute_t<T>, group> load_group(const T* p) {
  std::array<compute_t<T>, group> a;
  for (std::size_t l = 0; l < group; ++l) a[l] = load(p[l]);
  return a;
}

/// The compute type shared by the views Ts (their first's).
template <class... Ts>
using first_compute_t = compute_t<std::tuple_element_t<0, std::tuple<std::remove_cv_t<Ts>...>>>;

/// True when the element loops call `f` with `simd::pack` lvalues of one register
/// (`simd::native_lanes<C>` lanes; 32 bytes on the run-time AVX2 path): `f` opts in
/// (`simd::vectorizable_v`), every view has the same compute type C (float or double), and
/// `f` is invocable with one pack per view (after the tensor index when `Indexed`). Otherwise
/// the loops call `f` per element, as before. Both give the same bits: pack lanes run the
/// element's IEEE operations. The pack loops call a const local copy of `f` (so its constants
/// stay in registers): a vectorizable functor's call operator is const.
template <bool Indexed, class F, class... Ts>
inline constexpr bool use_packs = [] {
#if GRADAPT_SIMD_PACKS
  if constexpr (simd::vectorizable_v<F> && sizeof...(Ts) > 0) {
    using C = first_compute_t<Ts...>;
    if constexpr ((std::is_same_v<compute_t<Ts>, C> && ...)) {
      using P = simd::pack<C, simd::native_lanes<C>>;
      static_assert(group % P::size == 0, "a group must hold whole packs");
      if constexpr (Indexed)
        return std::is_invocable_v<const F&, tensor_index, std::conditional_t<true, P, Ts>&...>;
      else
        return std::is_invocable_v<const F&, std::conditional_t<true, P, Ts>&...>;
    }
  }
#endif
  return false;
}();

#if GRADAPT_SIMD_PACKS
/// [b, e) in packs P: loads every view's pack, calls f once, stores the non-const packs.
/// Returns where the scalar tail (< P::size elements) starts.
template <bool Indexed, class P, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t apply_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                             std::index_sequence<I...>, Ts*... p) {
  constexpr std::size_t W = P::size;
  const F fc = f;  // a local copy: its constants stay in registers across the stores
  std::size_t i = b;
  for (; i + W <= e; i += W) {
    P v[sizeof...(Ts)] = {simd::load_as<P>(p + i)...};
    if constexpr (Indexed)
      fc(t, v[I]...);
    else
      fc(v[I]...);
    (
        (void)[&] {
          if constexpr (!std::is_const_v<Ts>) simd::store(p + i, v[I]);
        }(),
        ...);
  }
  return i;
}

/// vacc[k][s] += r[k] for every k, unrolled at compile time.
template <std::size_t s, class WD, std::size_t K, std::size_t S, std::size_t... k>
GRADAPT_INLINE void add_terms(WD (&vacc)[K][S], const simd::vterms<K, WD>& r, std::index_sequence<k...>) {
  ((vacc[k][s] += r[k]), ...);
}

/// Pack s of a group at element o (s a compile-time index, so the accumulators stay in
/// registers): load, call, add the K values to vacc[k][s], store the non-const views.
template <bool Indexed, std::size_t s, class F, class P, class WD, std::size_t K, std::size_t S, class... Ts,
          std::size_t... I>
GRADAPT_INLINE void reduce_one_pack(const F& fc, tensor_index t, std::size_t o, WD (&vacc)[K][S],
                                    std::index_sequence<I...>, Ts*... p) {
  P v[sizeof...(Ts)] = {simd::load_as<P>(p + o)...};
  simd::vterms<K, WD> r;
  if constexpr (Indexed) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(fc(t, v[I]...))>, simd::vterms<K, WD>>,
                  "gradapt::host::apply_reduce_list: a vectorizable functor called on packs must return "
                  "gradapt::simd::terms_t<V, K> (simd::vterms<K, pack<double, W>>) with its scalar form's K");
    r = fc(t, v[I]...);
  } else {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(fc(v[I]...))>, simd::vterms<K, WD>>,
                  "gradapt::host::apply_reduce_list: a vectorizable functor called on packs must return "
                  "gradapt::simd::terms_t<V, K> (simd::vterms<K, pack<double, W>>) with its scalar form's K");
    r = fc(v[I]...);
  }
  add_terms<s>(vacc, r, std::make_index_sequence<K>{});
  (
      (void)[&] {
        if constexpr (!std::is_const_v<Ts>) simd::store(p + o, v[I]);
      }(),
      ...);
}

/// All `S` packs of the group at element i.
template <bool Indexed, class P, class F, class WD, std::size_t K, std::size_t S, std::size_t... s,
          std::size_t... I, class... Ts>
GRADAPT_INLINE void reduce_group_packs(const F& fc, tensor_index t, std::size_t i, WD (&vacc)[K][S],
                                       std::index_sequence<s...>, std::index_sequence<I...> seq, Ts*... p) {
  (reduce_one_pack<Indexed, s, F, P>(fc, t, i + s * P::size, vacc, seq, p...), ...);
}

/// Full groups of [b, e) of a fused apply + reduce through the pack form of f, `group / W`
/// packs P of W lanes per group. f returns `simd::vterms<K, pack<double, W>>`; lane w of pack
/// s of value k is added to acc[k][s * W + w], the lane the scalar loop uses for that element
/// of the group, in the same order. Returns where the scalar tail starts.
template <bool Indexed, std::size_t K, class P, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t apply_reduce_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                                    double (&acc)[K][lanes], std::index_sequence<I...>,
                                                    Ts*... p) {
  constexpr std::size_t W = P::size;
  constexpr std::size_t S = group / W;
  using WD = typename simd::wide_pack<P>::type;
  const F fc = f;  // a local copy: its constants stay in registers across the stores
  WD vacc[K][S];
  // Every access to vacc has a compile-time index (no loops over k or s), so the compiler
  // keeps the accumulators in registers instead of a stack slot that each group would load,
  // add to and store (a latency chain through store forwarding).
  [&]<std::size_t... j>(std::index_sequence<j...>) { ((vacc[j / S][j % S] = WD(0.0)), ...); }
  (std::make_index_sequence<K * S>{});
  std::size_t i = b;
  for (; i + group <= e; i += group)
    reduce_group_packs<Indexed, P>(fc, t, i, vacc, std::make_index_sequence<S>{}, std::index_sequence<I...>{},
                                   p...);
  [&]<std::size_t... j>(std::index_sequence<j...>) {
    (vacc[j / S][j % S].store(&acc[j / S][(j % S) * W]), ...);
  }
  (std::make_index_sequence<K * S>{});
  return i;
}

#if defined(GRADAPT_HOST_PACKS_AVX2)
/// The pack loops compiled for AVX2 (chosen at run time, like the reductions): 32-byte packs,
/// so one instruction handles 8 floats or 4 doubles. No FMA: every lane runs the same IEEE
/// operations as the SSE2 and scalar paths, so the bits are the same.
template <bool Indexed, class F, class... Ts, std::size_t... I>
__attribute__((target("avx2"), flatten)) std::size_t apply_pack_groups_avx2(F& f, tensor_index t,
                                                                            std::size_t b, std::size_t e,
                                                                            std::index_sequence<I...> seq,
                                                                            Ts*... p) {
  using C = first_compute_t<Ts...>;
  return apply_pack_groups<Indexed, simd::pack<C, 32 / sizeof(C), 32>>(f, t, b, e, seq, p...);
}
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
__attribute__((target("avx2"), flatten)) std::size_t apply_reduce_pack_groups_avx2(
    F& f, tensor_index t, std::size_t b, std::size_t e, double (&acc)[K][lanes],
    std::index_sequence<I...> seq, Ts*... p) {
  using C = first_compute_t<Ts...>;
  return apply_reduce_pack_groups<Indexed, K, simd::pack<C, 32 / sizeof(C), 32>>(f, t, b, e, acc, seq, p...);
}
#endif

/// The pack loop for [b, e): AVX2 when the CPU has it (GCC, x86-64), one 16-byte register
/// otherwise.
template <bool Indexed, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t run_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                           std::index_sequence<I...> seq, Ts*... p) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
  if (cpu_has_avx2()) return apply_pack_groups_avx2<Indexed>(f, t, b, e, seq, p...);
#endif
  using C = first_compute_t<Ts...>;
  return apply_pack_groups<Indexed, simd::pack<C, simd::native_lanes<C>>>(f, t, b, e, seq, p...);
}
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE std::size_t run_reduce_pack_groups(F& f, tensor_index t, std::size_t b, std::size_t e,
                                                  double (&acc)[K][lanes], std::index_sequence<I...> seq,
                                                  Ts*... p) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
  if (cpu_has_avx2()) return apply_reduce_pack_groups_avx2<Indexed, K>(f, t, b, e, acc, seq, p...);
#endif
  using C = first_compute_t<Ts...>;
  return apply_reduce_pack_groups<Indexed, K, simd::pack<C, simd::native_lanes<C>>>(f, t, b, e, acc, seq,
                                                                                    p...);
}
#else
template <bool Indexed, class F, class... Ts, std::size_t... I>
std::size_t run_pack_groups(F&, tensor_index, std::size_t b, std::size_t, std::index_sequence<I...>, Ts*...) {
  return b;
}
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
std::size_t run_reduce_pack_groups(F&, tensor_index, std::size_t b, std::size_t, double (&)[K][lanes],
                                   std::index_sequence<I...>, Ts*...) {
  return b;
}
#endif

/// Calls f on loaded copies of elements [b, e) of every pointer and stores back the non-const
/// ones. `Indexed` passes the tensor index first.
template <bool Indexed, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE void apply_range(F& f, tensor_index t, std::size_t b, std::size_t e, std::index_sequence<I...>,
                                Ts*... p) {
  const auto call = [&](auto&... v) {
    if constexpr (Indexed)
      f(t, v...);
    else
      f(v...);
  };
  std::size_t i = b;
  if constexpr (use_packs<Indexed, F, Ts...>) {
    i = run_pack_groups<Indexed>(f, t, b, e, std::index_sequence<I...>{}, p...);
  } else {
    for (; i + group <= e; i += group) {
      std::tuple<std::array<compute_t<Ts>, group>...> v{load_group(p + i)...};
      for (std::size_t l = 0; l < group; ++l) call(std::get<I>(v)[l]...);
      (
          (void)[&] {
            if constexpr (!std::is_const_v<Ts>)
              for (std::size_t l = 0; l < group; ++l) store(p[i + l], std::get<I>(v)[l]);
          }(),
          ...);
    }
  }
  for (; i < e; ++i) {
    std::tuple<compute_t<Ts>...> v{load(p[i])...};
    call(std::get<I>(v)...);
    (
        (void)[&] {
          if constexpr (!std::is_const_v<Ts>) store(p[i], std::get<I>(v));
        }(),
        ...);
  }
}

template <class F, class... Ts>
void apply_one(F& f, tensor_index t, std::size_t n, [[maybe_unused]] int threads, Ts*... p) {
  constexpr bool indexed = std::is_invocable_v<F&, tensor_index, compute_t<Ts>&...>;
  static_assert(indexed || std::is_invocable_v<F&, compute_t<Ts>&...>,
                "gradapt::host::apply: the functor must be callable with one compute-type lvalue "
                "reference per view (float& for float/half/bfloat16, double& for double), "
                "optionally preceded by gradapt::tensor_index");
  const auto run = [&](std::size_t b, std::size_t e) {
    apply_range<indexed>(f, t, b, e, std::index_sequence_for<Ts...>{}, p...);
  };
#if defined(_OPENMP)
  if (threads > 1 && n >= 2 * apply_chunk) {
    const std::size_t nchunks = (n + apply_chunk - 1) / apply_chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::size_t c = 0; c < nchunks; ++c) run(c * apply_chunk, std::min(n, (c + 1) * apply_chunk));
    return;
  }
#endif
  run(0, n);
}

/// Element type (with const) of the views in a list.
template <class L>
using list_elem_t = std::remove_pointer_t<decltype(std::ranges::data(std::declval<const L&>())[0].data())>;

/// Result type and value count of an apply_reduce functor called on compute-type lvalues.
template <bool Indexed, class F, class... Ts>
struct reduce_result {
  using type = typename std::conditional_t<Indexed, std::invoke_result<F&, tensor_index, compute_t<Ts>&...>,
                                           std::invoke_result<F&, compute_t<Ts>&...>>::type;
  static constexpr std::size_t size = terms_size<std::remove_cvref_t<type>>::value;
};

/// Value k of one functor result (a scalar or terms<K>) as a double.
template <class R>
GRADAPT_INLINE double term_value(const R& r, [[maybe_unused]] std::size_t k) {
  if constexpr (std::is_arithmetic_v<R>)
    return static_cast<double>(r);
  else
    return r[k];
}

/// One block (at most `block` elements starting at b) of a fused apply + reduce: the functor
/// runs on groups of `group` (== lanes) elements; the value of element l of a group goes to
/// accumulator lane l, so lane assignment, the lane tree and therefore the partials equal
/// reduce_block's for the same terms. Writes K partials into part[0, K).
template <bool Indexed, std::size_t K, class F, class... Ts, std::size_t... I>
GRADAPT_INLINE void apply_reduce_block(F& f, tensor_index t, std::size_t b, std::size_t e, double* part,
                                       std::index_sequence<I...>, Ts*... p) {
  static_assert(group == lanes, "apply_reduce maps group position to accumulator lane");
  const auto call = [&](auto&... v) {
    if constexpr (Indexed)
      return f(t, v...);
    else
      return f(v...);
  };
  double acc[K][lanes] = {};
  std::size_t i = b;
  if constexpr (use_packs<Indexed, F, Ts...>) {
    i = run_reduce_pack_groups<Indexed, K>(f, t, b, e, acc, std::index_sequence<I...>{}, p...);
  } else {
    for (; i + group <= e; i += group) {
      std::tuple<std::array<compute_t<Ts>, group>...> v{load_group(p + i)...};
      for (std::size_t l = 0; l < group; ++l) {
        const auto r = call(std::get<I>(v)[l]...);
        for (std::size_t k = 0; k < K; ++k) acc[k][l] += term_value(r, k);
      }
      (
          (void)[&] {
            if constexpr (!std::is_const_v<Ts>)
              for (std::size_t l = 0; l < group; ++l) store(p[i + l], std::get<I>(v)[l]);
          }(),
          ...);
    }
  }
  for (std::size_t l = 0; i < e; ++i, ++l) {
    std::tuple<compute_t<Ts>...> v{load(p[i])...};
    const auto r = call(std::get<I>(v)...);
    for (std::size_t k = 0; k < K; ++k) acc[k][l] += term_value(r, k);
    (
        (void)[&] {
          if constexpr (!std::is_const_v<Ts>) store(p[i], std::get<I>(v));
        }(),
        ...);
  }
  for (std::size_t k = 0; k < K; ++k) part[k] = combine_lanes<rk::sum>(acc[k]);
}

/// Fused apply + reduce over one tensor of n elements: block partials by rounds of
/// `round_blocks` (computed by up to `threads` threads), added in block order into out[0, K).
/// The result does not depend on the thread count.
template <std::size_t K, class F, class... Ts>
void apply_reduce_one(F& f, tensor_index t, std::size_t n, [[maybe_unused]] int threads, double* out,
                      Ts*... p) {
  constexpr bool indexed = std::is_invocable_v<F&, tensor_index, compute_t<Ts>&...>;
  const std::size_t nblocks = (n + block - 1) / block;
  for (std::size_t k = 0; k < K; ++k) out[k] = 0.0;
  double part[round_blocks][K];
  const auto blk = [&](std::size_t r0, std::size_t j) {
    const std::size_t b = (r0 + j) * block;
    apply_reduce_block<indexed, K>(f, t, b, std::min(n, b + block), part[j], std::index_sequence_for<Ts...>{},
                                   p...);
  };
  const auto add = [&](std::size_t rb) {
    for (std::size_t j = 0; j < rb; ++j)
      for (std::size_t k = 0; k < K; ++k) out[k] += part[j][k];
  };
#if defined(_OPENMP)
  if (threads > 1 && n >= parallel_min) {
    // Rounds of 2 * round_blocks blocks in two alternating buffers: one thread adds round r's
    // partials (single nowait) while the others compute round r + 1 into the other buffer, so
    // a round costs one barrier (the loop's) instead of two, and there are half as many
    // rounds. Round r + 2 reuses round r's buffer only after round r + 1's loop barrier, which
    // the adding thread reaches after its additions. Same partials, same order of additions.
    constexpr std::size_t R = 2 * round_blocks;
    double twin[2][R][K];
#pragma omp parallel num_threads(threads)
    {
      std::size_t buf = 0;
      for (std::size_t r0 = 0; r0 < nblocks; r0 += R, buf ^= 1) {
        const std::size_t rb = std::min(R, nblocks - r0);
#pragma omp for schedule(static)
        for (std::size_t j = 0; j < rb; ++j) {
          const std::size_t b = (r0 + j) * block;
          apply_reduce_block<indexed, K>(f, t, b, std::min(n, b + block), twin[buf][j],
                                         std::index_sequence_for<Ts...>{}, p...);
        }
#pragma omp single nowait
        for (std::size_t j = 0; j < rb; ++j)
          for (std::size_t k = 0; k < K; ++k) out[k] += twin[buf][j][k];
      }
    }
    return;
  }
#endif
  for (std::size_t r0 = 0; r0 < nblocks; r0 += round_blocks) {
    const std::size_t rb = std::min(round_blocks, nblocks - r0);
    for (std::size_t j = 0; j < rb; ++j) blk(r0, j);
    add(rb);
  }
}

}  // namespace gradapt::detail::host_impl
