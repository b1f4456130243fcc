#pragma once
/// @file
/// The host backend's row and column kernels over a tensor seen as [A, X, B, Y, C] (part of
/// gradapt::host, backend/host.hpp): reduce_factored's line and column loops (one read of
/// each line on any thread count), the statistics pass that also sums a second tensor's
/// squares, apply_factored's line loop with an optional fixed-order sum, and
/// apply_factored_max's loop with row and column maxima. Float data (C == 1) runs on
/// `simd::pack`s of 8, on AVX2 when the CPU has it; the scalar loops give the same bits.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

#include "gradapt/backend/factored_checks.hpp"
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

/// The kernels behind gradapt::host's factored operations (static members: the backend's
/// public functions check their arguments and call these).
struct factored {
  static std::array<std::size_t, 5> check_factored(const std::array<std::int64_t, 5>& d, std::size_t n,
                                                   const char* what) {
    return factored_dims(d, n, "host backend ", what);
  }
  /// check_factored, then the row vector (`rows` entries: A*X*B*C, or 0 for none) and the
  /// column vector (`cols` entries: A*B*Y*C, or 0) of operation `what`.
  static std::array<std::size_t, 5> check_factored(const std::array<std::int64_t, 5>& d, std::size_t n,
                                                   std::size_t rows, std::size_t cols, const char* what) {
    const auto e = check_factored(d, n, what);
    check_factored_vector("host backend ", what, "row vector", rows, e[0] * e[1] * e[2] * e[4], "A*X*B*C");
    check_factored_vector("host backend ", what, "column vector", cols, e[0] * e[2] * e[3] * e[4], "A*B*Y*C");
    return e;
  }

  /// Longest line (Y with C == 1) that reduce_factored reads once on any number of threads
  /// (a per-thread partial of this many doubles lives on the stack: 32 KiB).
  static constexpr std::size_t group_line_max = 4096;
  /// Lines per group of that path: about 256 KiB of float data, at least 16 lines. Depends
  /// only on the line length, so the results do not depend on the thread count.
  static constexpr std::size_t group_lines(std::size_t L) {
    return std::max<std::size_t>(16, (std::size_t{1} << 16) / std::max<std::size_t>(L, 1));
  }

  template <bool Max>
  static GRADAPT_INLINE double fold(double a, double t) {
    if constexpr (Max)
      return (a != a || t != t) ? std::numeric_limits<double>::quiet_NaN() : (a < t ? t : a);
    else
      return a + t;
  }

  template <bool Max, class F, class RY, class RX, class T, class U = const float>
  static void reduce_factored_impl(int nt, const F& f, const RY* rp, const RX* cp, const T* x, std::size_t A,
                                   std::size_t X, std::size_t B, std::size_t Y, std::size_t C, double* oy,
                                   bool skip_y, double* ox, bool skip_x, U* ys = nullptr,
                                   double* ls = nullptr) {
    const auto run = [&]<bool HasR, bool HasC>() {
      reduce_factored_loops<Max, HasR, HasC>(nt, f, rp, cp, x, A, X, B, Y, C, oy, skip_y, ox, skip_x, ys, ls);
    };
    if (rp && cp)
      run.template operator()<true, true>();
    else if (rp)
      run.template operator()<true, false>();
    else if (cp)
      run.template operator()<false, true>();
    else
      run.template operator()<false, false>();
  }

  /// reduce_factored's loops with the presence of the row and column vectors fixed at compile
  /// time (no per-element branches or index divisions).
  /// With `ys` (and !skip_y), ls[l] = line_sumsq of line l of ys, read next to line l of x.
  template <bool Max, bool HasR, bool HasC, class F, class RY, class RX, class T, class U>
  static void reduce_factored_loops(int nt, const F& f, const RY* rp, const RX* cp, const T* x, std::size_t A,
                                    std::size_t X, std::size_t B, std::size_t Y, std::size_t C, double* oy,
                                    bool skip_y, double* ox, bool skip_x, U* ys, double* ls) {
    const std::size_t L = Y * C, lines = A * X * B, n = lines * L;
    const double init = Max ? -std::numeric_limits<double>::infinity() : 0.0;
    if (!skip_y)
      for (std::size_t k = 0; k < lines * C; ++k) oy[k] = init;
    if (!skip_x)
      for (std::size_t k = 0; k < A * B * L; ++k) ox[k] = init;
    if (n == 0 || (skip_x && skip_y)) return;
    const bool par = nt > 1 && n >= 2 * detail::host_impl::apply_chunk;
    (void)par;
    using CY = compute_t<RY>;
    using CX = compute_t<RX>;
    const auto rv = [&](std::size_t i) { return HasR ? load(rp[i]) : CY(1); };
    const auto cv = [&](const RX* c, std::size_t k) {
      if constexpr (HasC)
        return load(c[k]);
      else
        return CX(1);
    };
    // Lines are processed in blocks of about 256 KiB so that the column reduction re-reads them
    // from cache.
    const std::size_t per_block =
        std::max<std::size_t>(1, (std::size_t{1} << 16) / std::max<std::size_t>(L, 1));
    constexpr std::size_t chunk = 512;  // columns per task of the column reduction
    const std::size_t col_tasks = (L + chunk - 1) / chunk;
#if GRADAPT_SIMD_PACKS
    // Sums of float data through a vectorizable f: 8 lanes per call (f returns a float pack,
    // widened), the same terms in the same order as the scalar loops.
    using narrow = simd::pack<float, 8>;
    constexpr bool packs =
        !Max && simd::vectorizable_v<F> && std::is_same_v<std::remove_cv_t<T>, float> &&
        (!HasR || std::is_same_v<std::remove_cv_t<RY>, float>)&&(
            !HasC || std::is_same_v<std::remove_cv_t<RX>, float>)&&std::is_invocable_v<const F&, narrow,
                                                                                       narrow, narrow>;
#endif
    // Line l (C == 1) of slice `cb`'s column vector: its row result into oy[l] (and Σ y² into
    // ls[l]); with `cols` (std::true_type) also its column terms folded into o[0, Y).
    const auto row_line = [&](auto cols, std::size_t l, const RX* cb, double* o) {
      constexpr bool Cols = decltype(cols)::value;
      const T* p = x + l * L;
      const CY r = rv(l);
      double acc[8] = {init, init, init, init, init, init, init, init};
      double yacc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::size_t j = 0, yk = 0;
#if GRADAPT_SIMD_PACKS
      // lane q of the double pack is acc[q]: the same terms in the same order
      if constexpr (packs)
        j = fact_lines_y < Cols ? fact_kind::both : fact_kind::rows,
        HasC > (f, static_cast<float>(r), cb, p, Y, o, acc, ys ? ys + l * L : ys, yacc, &yk);
#endif
      const auto term = [&](std::size_t q, std::size_t at) {
        const double t = static_cast<double>(f(r, cv(cb, at), load(p[at])));
        acc[q] = fold<Max>(acc[q], t);
        if constexpr (Cols) o[at] = fold<Max>(o[at], t);
      };
      for (; j + 8 <= Y; j += 8)
        for (std::size_t q = 0; q < 8; ++q) term(q, j + q);
      for (std::size_t q = 0; j < Y; ++j, ++q) term(q, j);
      for (std::size_t w = 4; w >= 1; w /= 2)
        for (std::size_t q = 0; q < w; ++q) acc[q] = fold<Max>(acc[2 * q], acc[2 * q + 1]);
      oy[l] = acc[0];
      if (ys) ls[l] = line_sumsq(ys + l * L, L, yk, yacc);
    };
    // Both outputs of a matrix-like view with lines of at most group_line_max elements, on any
    // number of threads: one read of each line feeds its row lanes and the column results. The
    // lines of a slice (a, b) form groups of G lines (G depends only on L); a group's column
    // terms are folded in ascending i into a per-thread partial, and the partials are folded
    // into the outputs in group order (an ordered loop). So the result does not depend on the
    // thread count, and no line is read twice or by two threads.
    if (C == 1 && !skip_y && !skip_x && L <= group_line_max) {
      const std::size_t G = group_lines(L), per_slice = (X + G - 1) / G, tasks = A * B * per_slice;
      // Group q (of slice q / per_slice) into part[0, L), then part into the outputs.
      const auto group = [&](std::size_t q, double* part) {
        const std::size_t sl = q / per_slice, i0 = (q % per_slice) * G, i1 = std::min(X, i0 + G);
        for (std::size_t k = 0; k < L; ++k) part[k] = init;
        for (std::size_t i = i0; i < i1; ++i)
          row_line(std::true_type{}, (sl / B * X + i) * B + sl % B, HasC ? cp + sl * L : nullptr, part);
      };
      const auto add = [&](std::size_t q, const double* part) {
        double* o = ox + (q / per_slice) * L;
        for (std::size_t k = 0; k < L; ++k) o[k] = fold<Max>(o[k], part[k]);
      };
#if defined(_OPENMP)
      if (par) {
#pragma omp parallel num_threads(nt)
        {
          double part[group_line_max];
#pragma omp for ordered schedule(static, 1)
          for (std::size_t q = 0; q < tasks; ++q) {
            group(q, part);
#pragma omp ordered
            add(q, part);
          }
        }
        return;
      }
#endif
      double part[group_line_max];
      for (std::size_t q = 0; q < tasks; ++q) {
        group(q, part);
        add(q, part);
      }
      return;
    }
    // Longer lines, one thread, both outputs: one read of each line feeds its row lanes and the
    // column sums (the same terms, in the same order, as the two loops below).
    if (!par && C == 1 && !skip_y && !skip_x) {
      for (std::size_t sl = 0; sl < A * B; ++sl)
        for (std::size_t i = 0; i < X; ++i)
          row_line(std::true_type{}, (sl / B * X + i) * B + sl % B, HasC ? cp + sl * L : nullptr,
                   ox + sl * L);
      return;
    }
    // One parallel region, no barrier inside: rows are independent, and the column loop has
    // the same trip count in every block, so with schedule(static) each column chunk stays
    // with one thread, which adds the blocks in order.
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) if (par)
#endif
    for (std::size_t a = 0; a < A; ++a)
      for (std::size_t b = 0; b < B; ++b) {
        const RX* cb = HasC ? cp + (a * B + b) * L : nullptr;
        for (std::size_t i0 = 0; i0 < X; i0 += per_block) {
          const std::size_t i1 = std::min(X, i0 + per_block);
          {
            if (!skip_y) {
#if defined(_OPENMP)
#pragma omp for schedule(static) nowait
#endif
              for (std::size_t i = i0; i < i1; ++i) {
                const std::size_t l = (a * X + i) * B + b;
                if (C == 1) {
                  row_line(std::false_type{}, l, cb, nullptr);
                } else {
                  const T* p = x + l * L;
                  double* o = oy + l * C;
                  for (std::size_t j = 0; j < Y; ++j)
                    for (std::size_t c = 0; c < C; ++c)
                      o[c] = fold<Max>(
                          o[c], static_cast<double>(f(rv(l * C + c), cv(cb, j * C + c), load(p[j * C + c]))));
                  if (ys) ls[l] = line_sumsq(ys + l * L, L);
                }
              }
            }
            if (!skip_x) {
#if defined(_OPENMP)
#pragma omp for schedule(static) nowait
#endif
              for (std::size_t task = 0; task < col_tasks; ++task) {
                const std::size_t k0 = task * chunk, k1 = std::min(L, k0 + chunk);
                double* o = ox + (a * B + b) * L;
                for (std::size_t i = i0; i < i1; ++i) {
                  const std::size_t l = (a * X + i) * B + b;
                  const T* p = x + l * L;
                  if (C == 1) {
                    const CY r = rv(l);
                    std::size_t k = k0;
#if GRADAPT_SIMD_PACKS
                    if constexpr (packs)
                      k = fact_lines<fact_kind::columns, HasC>(f, static_cast<float>(r), cb, p, k0, k1, o,
                                                               nullptr);
#endif
                    for (; k < k1; ++k)
                      o[k] = fold<Max>(o[k], static_cast<double>(f(r, cv(cb, k), load(p[k]))));
                  } else {
                    std::size_t c = k0 % C;
                    for (std::size_t k = k0; k < k1; ++k) {
                      o[k] = fold<Max>(o[k], static_cast<double>(f(rv(l * C + c), cv(cb, k), load(p[k]))));
                      c = c + 1 == C ? 0 : c + 1;
                    }
                  }
                }
              }
            }
          }
        }
      }
  }

#if GRADAPT_SIMD_PACKS
  /// acc += t part by part (a fold over the parts: no loop is left for -O2 to keep in memory).
  template <class D, std::size_t... I>
  static GRADAPT_INLINE void add_parts(D& acc, const D& t, std::index_sequence<I...>) {
    ((acc.part[I] = acc.part[I] + t.part[I]), ...);
  }
  /// o[0, D::size) += t, part by part.
  template <class D, std::size_t... I>
  static GRADAPT_INLINE void add_parts_to(double* o, const D& t, std::index_sequence<I...>) {
    (
        [&] {
          typename D::native v;
          std::memcpy(&v, o + I * D::part_lanes, sizeof v);
          v = v + t.part[I];
          std::memcpy(o + I * D::part_lanes, &v, sizeof v);
        }(),
        ...);
  }

  /// What a pack loop of reduce_factored computes for one line: its row lanes, its column sums,
  /// or both from one read.
  enum class fact_kind { rows, columns, both };

#if defined(GRADAPT_HOST_PACKS_AVX2)
  /// `Loop::run<P>(args...)` compiled for AVX2: P holds 8 floats in one 32-byte register (no
  /// FMA, so the same bits as on 16-byte registers).
  template <class Loop, class... A>
  __attribute__((target("avx2"), flatten)) static std::size_t run_packs_avx2(A&&... args) {
    return Loop::template run<simd::pack<float, 8, 32>>(std::forward<A>(args)...);
  }
#endif
  /// Runs the pack loop `Loop::run<P>(args...)` (P a pack of 8 floats, inlined) on AVX2 when
  /// the CPU has it, else on 16-byte registers; returns what the loop returns (elements done).
  template <class Loop, class... A>
  static GRADAPT_INLINE std::size_t run_packs(A&&... args) {
#if defined(GRADAPT_HOST_PACKS_AVX2)
    if (detail::host_impl::cpu_has_avx2()) return run_packs_avx2<Loop>(std::forward<A>(args)...);
#endif
    return Loop::template run<simd::pack<float, 8>>(std::forward<A>(args)...);
  }
  /// The pack loops of this struct in the form run_packs takes.
  template <fact_kind K, bool HasC, bool HasY>
  struct fact_loop {
    template <class P, class... A>
    static GRADAPT_INLINE std::size_t run(A&&... a) {
      return fact_packs<P, K, HasC, HasY>(std::forward<A>(a)...);
    }
  };
  struct sumsq_loop {
    template <class P, class... A>
    static GRADAPT_INLINE std::size_t run(A&&... a) {
      return sumsq_packs<P>(std::forward<A>(a)...);
    }
  };
  template <bool Reduces>
  struct factored_loop {
    template <class P, class... A>
    static GRADAPT_INLINE std::size_t run(A&&... a) {
      return factored_packs<Reduces, P>(std::forward<A>(a)...);
    }
  };
  struct max_loop {
    template <class P, class... A>
    static GRADAPT_INLINE std::size_t run(A&&... a) {
      return max_packs<P>(std::forward<A>(a)...);
    }
  };

  /// reduce_factored's pack loop (sums, float data, C == 1) over elements [j0, j1) of one line
  /// p, in packs NP of 8 floats: rows: lane q of the double accumulator is acc[q] (element j
  /// into lane j mod 8); columns: o[j] += term j. With HasY, also y's squares (widened) into
  /// lane j mod 8 of yacc (line_sumsq's terms), read in the same loop. Returns the first
  /// element not done.
  template <class NP, fact_kind K, bool HasC, bool HasY, class F, class RX, class T>
  static GRADAPT_INLINE std::size_t fact_packs(const F& f, float r, const RX* cb, const T* p, std::size_t j0,
                                               std::size_t j1, double* o, double* acc, const float* y,
                                               double* yacc) {
    using D = decltype(simd::widen(std::declval<const NP&>()));
    constexpr auto I = std::make_index_sequence<D::parts>{};
    const NP rr(r), one(1.0f);
    D va(0.0), vy(0.0);
    std::size_t j = j0;
    for (; j + 8 <= j1; j += 8) {
      const D t = simd::widen(f(rr, HasC ? NP::load(cb + j) : one, NP::load(p + j)));
      if constexpr (K != fact_kind::columns) add_parts(va, t, I);
      if constexpr (K != fact_kind::rows) add_parts_to(o + j, t, I);
      if constexpr (HasY) add_squares(vy, simd::widen(NP::load(y + j)), I);
    }
    if constexpr (K != fact_kind::columns) va.store(acc);
    if constexpr (HasY) vy.store(yacc);
    return j;
  }
  /// fact_packs on AVX2 when the CPU has it, else on 16-byte registers.
  template <fact_kind K, bool HasC, bool HasY = false, class F, class RX, class T>
  static GRADAPT_INLINE std::size_t fact_lines(const F& f, float r, const RX* cb, const T* p, std::size_t j0,
                                               std::size_t j1, double* o, double* acc,
                                               const float* y = nullptr, double* yacc = nullptr) {
    return run_packs<fact_loop<K, HasC, HasY>>(f, r, cb, p, j0, j1, o, acc, y, yacc);
  }
  /// A rows or both pass over line l (C == 1, packs), with y's squares read in the same loop
  /// when y is float and present: returns the first element not done; *yk is how many of
  /// y's elements are in yacc (0: none).
  template <fact_kind K, bool HasC, class F, class RX, class T, class U>
  static GRADAPT_INLINE std::size_t fact_lines_y(const F& f, float r, const RX* cb, const T* p, std::size_t Y,
                                                 double* o, double* acc, U* y, double* yacc,
                                                 std::size_t* yk) {
    *yk = 0;
    if constexpr (std::is_same_v<std::remove_cv_t<U>, float>) {
      if (y) {
        const std::size_t j = fact_lines<K, HasC, true>(f, r, cb, p, 0, Y, o, acc, y, yacc);
        *yk = j;
        return j;
      }
    }
    return fact_lines<K, HasC>(f, r, cb, p, 0, Y, o, acc);
  }
#endif

  /// Σ_k y_k² of one line (widened to double before squaring): element k into lane k mod 8,
  /// lanes combined as a fixed tree (the same bits on the pack and scalar paths).
  /// With k > 0, the first k elements (k a multiple of 8) are already in pre[0, 8) (lanes).
  template <class U>
  static double line_sumsq(U* y, std::size_t L, std::size_t k = 0, const double* pre = nullptr) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (k > 0)
      for (std::size_t q = 0; q < 8; ++q) acc[q] = pre[q];
#if GRADAPT_SIMD_PACKS
    if constexpr (std::is_same_v<std::remove_cv_t<U>, float>) {
      if (k == 0) {
        k = run_packs<sumsq_loop>(y, L, acc);
      }
    }
#endif
    for (; k + 8 <= L; k += 8)
      for (std::size_t q = 0; q < 8; ++q) {
        const double w = static_cast<double>(load(y[k + q]));
        acc[q] += w * w;
      }
    for (std::size_t q = 0; k < L; ++k, ++q) {
      const double w = static_cast<double>(load(y[k]));
      acc[q] += w * w;
    }
    for (std::size_t w = 4; w >= 1; w /= 2)
      for (std::size_t q = 0; q < w; ++q) acc[q] = acc[2 * q] + acc[2 * q + 1];
    return acc[0];
  }
#if GRADAPT_SIMD_PACKS
  template <class D, std::size_t... I>
  static GRADAPT_INLINE void add_squares(D& acc, const D& w, std::index_sequence<I...>) {
    ((acc.part[I] = acc.part[I] + w.part[I] * w.part[I]), ...);
  }
  /// line_sumsq's pack loop: lane q of the double accumulator is acc[q].
  template <class P>
  static GRADAPT_INLINE std::size_t sumsq_packs(const float* y, std::size_t L, double* acc) {
    using D = decltype(simd::widen(std::declval<const P&>()));
    D va(0.0);
    std::size_t k = 0;
    for (; k + 8 <= L; k += 8)
      add_squares(va, simd::widen(P::load(y + k)), std::make_index_sequence<D::parts>{});
    va.store(acc);
    return k;
  }
#endif

  /// One group of 8 elements of apply_factored's pack path: loads, call, stores (inlined, so
  /// the packs stay in registers).
  template <class T, class P>
  static GRADAPT_INLINE void store_pack(const P& v, T* dst) {
    if constexpr (!std::is_const_v<T>) v.store(dst);
  }
  template <bool Reduces, class F, class P, class D, class... Ts, std::size_t... I>
  static GRADAPT_INLINE void factored_pack(const F& f, const P& r, const P& c, D& va, std::size_t at,
                                           std::index_sequence<I...>, Ts*... ptrs) {
    P v[sizeof...(Ts)] = {P::load(ptrs + at)...};
    if constexpr (Reduces)
      add_parts(va, simd::widen(f(r, c, v[I]...)), std::make_index_sequence<D::parts>{});
    else
      f(r, c, v[I]...);
    (store_pack(v[I], ptrs + at), ...);
  }

  /// apply_factored's pack loop over one line of L elements (C == 1, float data): packs P of
  /// 8 floats, lane q of the double accumulator is acc[q]. Returns the elements done.
  template <bool Reduces, class P, class F, class... Ts>
  static GRADAPT_INLINE std::size_t factored_packs(const F& f, float rv, const float* cp, std::size_t L,
                                                   double* acc, Ts*... ptrs) {
    using D = decltype(simd::widen(std::declval<const P&>()));
    D va(0.0);
    const P r(rv);
    std::size_t k = 0;
    for (; k + 8 <= L; k += 8)
      factored_pack<Reduces>(f, r, P::load(cp + k), va, k, std::index_sequence_for<Ts...>{}, ptrs...);
    if constexpr (Reduces) va.store(acc);
    return k;
  }

#if GRADAPT_SIMD_PACKS
  /// True when a line of `f` over row entries RY, column entries RX and data Ts... runs on
  /// packs of 8 floats: every type is float and f opts in to packs and takes them.
  template <class F, class RY, class RX, class... Ts>
  static constexpr bool float_packs_v =
      std::conjunction_v<std::is_same<std::remove_cv_t<RY>, float>, std::is_same<std::remove_cv_t<RX>, float>,
                         std::is_same<std::remove_cv_t<Ts>, float>...,
                         std::bool_constant<simd::vectorizable_v<F>>,
                         std::is_invocable<const F&, simd::pack<float, 8>, simd::pack<float, 8>,
                                           std::conditional_t<true, simd::pack<float, 8>, Ts>&...>>;
#endif

  /// Element k of a line on scalars: calls f(row entry, column entry, data...) in compute
  /// types (row entries at rbase + (k mod C), column entries at cbase + k, 1 where absent; data
  /// at base + k), stores the data back into the non-const views and returns f's result.
  template <class F, class RY, class RX, class... Ts>
  static GRADAPT_INLINE auto line_element(const F& f, std::size_t k, std::size_t base, std::size_t C,
                                          const RY* rp, std::size_t rbase, const RX* cp, std::size_t cbase,
                                          Ts*... ptrs) {
    const auto r = rp ? load(rp[rbase + k % C]) : compute_t<RY>(1);
    const auto c = cp ? load(cp[cbase + k]) : compute_t<RX>(1);
    auto v = std::make_tuple(load(ptrs[base + k])...);
    return std::apply(
        [&](auto&... e) {
          const auto store_all = [&] {
            (
                [&] {
                  if constexpr (!std::is_const_v<Ts>) store(ptrs[base + k], e);
                }(),
                ...);
          };
          if constexpr (std::is_void_v<decltype(f(r, c, e...))>) {
            f(r, c, e...);
            store_all();
          } else {
            const auto t = f(r, c, e...);
            store_all();
            return t;
          }
        },
        v);
  }

  /// One line of apply_factored: elements [base, base + L), row entries at rbase + (k mod C),
  /// column entries at cbase + k.
  template <bool Reduces, class F, class RY, class RX, class... Ts>
  static double factored_line(const F& f, std::size_t base, std::size_t L, std::size_t C, const RY* rp,
                              std::size_t rbase, const RX* cp, std::size_t cbase, Ts*... ptrs) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::size_t k = 0;
#if GRADAPT_SIMD_PACKS
    if constexpr (float_packs_v<F, RY, RX, Ts...>) {
      if (C == 1 && cp != nullptr) {
        // lane q of the double pack is acc[q]: element k + q of each group of 8
        const float r = rp ? rp[rbase] : 1.0f;
        k = run_packs<factored_loop<Reduces>>(f, r, cp + cbase, L, acc, ptrs + base...);
      }
    }
#endif
    for (; k < L; ++k) {
      if constexpr (Reduces)
        acc[k % 8] += static_cast<double>(line_element(f, k, base, C, rp, rbase, cp, cbase, ptrs...));
      else
        line_element(f, k, base, C, rp, rbase, cp, cbase, ptrs...);
    }
    if constexpr (Reduces) {
      for (std::size_t w = 4; w >= 1; w /= 2)
        for (std::size_t q = 0; q < w; ++q) acc[q] = acc[2 * q] + acc[2 * q + 1];
      return acc[0];
    } else {
      return 0.0;
    }
  }

  /// max(acc, t) that keeps a NaN from either side (t where acc < t or t is NaN, else acc).
  template <class V>
  static GRADAPT_INLINE V nan_max(const V& acc, const V& t) {
    return simd::select((acc < t) | (t != t), t, acc);
  }
  /// `t > m ? t : m` lane-wise (x86's maxps): m when either is NaN, so a NaN m stays.
  template <class V>
  static GRADAPT_INLINE V gt_max(const V& t, const V& m) {
#if GRADAPT_SIMD_PACKS
    if constexpr (simd::is_pack_v<V>)
      return simd::gt_max(t, m);
    else
#endif
      return t > m ? t : m;
  }
#if GRADAPT_SIMD_PACKS
  /// apply_factored_max's pack loop over one line (C == 1, float data): packs P of 8 floats;
  /// the row maximum is folded into *ry, the column maxima into cx, with `t > m ? t : m` (one
  /// `maxps`, which keeps a NaN maximum m but drops a NaN term t); *bad is set when a term was
  /// NaN (max_line then puts the NaN in). Returns the elements done.
  template <class P, class F, class... Ts, std::size_t... I>
  static GRADAPT_INLINE std::size_t max_packs(const F& fr, float rv, const float* cp, std::size_t L,
                                              float* ry, float* cx, bool* bad, std::index_sequence<I...>,
                                              Ts*... ptrs) {
    const F f = fr;  // a local copy: the stores through float pointers cannot change its members
    const P r(rv), zero(0.0f);
    P ra(-std::numeric_limits<float>::infinity());
    auto nan = zero != zero;
    std::size_t k = 0;
    for (; k + 8 <= L; k += 8) {
      P v[sizeof...(Ts)] = {P::load(ptrs + k)...};
      const P t = f(r, P::load(cp + k), v[I]...);
      nan = nan | (t != t);
      ra = gt_max(t, ra);
      gt_max(t, P::load(cx + k)).store(cx + k);
      (store_pack(v[I], ptrs + k), ...);
    }
    float lanes[8];
    ra.store(lanes);
    for (const float x : lanes) *ry = gt_max(x, *ry);
    *bad = nan.any();
    return k;
  }
#endif

  /// One line of apply_factored_max: elements [base, base + L), row entries and row maxima at
  /// rbase + (k mod C) (maxima at ry[k mod C]), column entries at cbase + k (maxima at cx[k]).
  /// A line whose pack loop met a NaN term is looked at again through `f.term` (which reads
  /// only what f does not write): its row maximum and the maxima of the NaN terms' columns
  /// become NaN.
  template <class F, class RY, class RX, class M, class... Ts>
  static void max_line(const F& f, std::size_t base, std::size_t L, std::size_t C, const RY* rp,
                       std::size_t rbase, const RX* cp, std::size_t cbase, M* ry, M* cx, Ts*... ptrs) {
    std::size_t k = 0;
    [[maybe_unused]] bool bad = false;
#if GRADAPT_SIMD_PACKS
    if constexpr (std::is_same_v<M, float> && float_packs_v<F, RY, RX, Ts...>) {
      if (C == 1 && cp != nullptr) {
        const float r = rp ? rp[rbase] : 1.0f;
        k = run_packs<max_loop>(f, r, cp + cbase, L, ry, cx, &bad, std::index_sequence_for<Ts...>{},
                                ptrs + base...);
        if (bad) {
          ry[0] = std::numeric_limits<M>::quiet_NaN();
          for (std::size_t j = 0; j < k; ++j) {
            auto v = std::make_tuple(load(ptrs[base + j])...);
            const M t = std::apply(
                [&](auto&... e) { return static_cast<M>(f.term(r, load(cp[cbase + j]), e...)); }, v);
            if (t != t) cx[j] = t;
          }
        }
      }
    }
#endif
    for (; k < L; ++k) {
      const M t = static_cast<M>(line_element(f, k, base, C, rp, rbase, cp, cbase, ptrs...));
      ry[k % C] = nan_max(ry[k % C], t);
      cx[k] = nan_max(cx[k], t);
    }
  }
};

}  // namespace gradapt::detail::host_impl
