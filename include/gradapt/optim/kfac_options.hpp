#pragma once
/// @file
/// The K-FAC configuration and its inputs: `kfac_options` and `kfac_method`, the layer
/// registration `kfac_layer` and the gradient view `kfac_grad` that `gradapt::kfac` (kfac.hpp)
/// takes.

#include <cstdint>
#include <ranges>
#include <string>
#include <type_traits>

#include "gradapt/core/dtype.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// How K-FAC preconditions with its factors.
enum class kfac_method : unsigned char {
  eigen,    ///< eigendecompositions; the damping is added to the Kronecker product's eigenvalues
  inverse,  ///< explicit damped inverses of each factor (computed through the eigendecomposition)
};

/// One layer K-FAC preconditions: a weight of `out` × `in` and, with `bias`, a bias of `out`.
/// A convolution registers in = in_channels·kh·kw (its unfolded patches) and out = out_channels.
struct kfac_layer {
  std::string name;      ///< for messages and checkpoints (unique)
  std::int64_t in = 0;   ///< columns of a (>= 1)
  std::int64_t out = 0;  ///< columns of g (>= 1)
  bool bias = false;     ///< a gets a column of ones; the gradient has a bias part
};

/// A layer's gradient for `kfac::step`, rewritten in place: weight (out × in, row-major) and,
/// for a layer with a bias, the bias (out), in memory space `Space` (the state's: host memory,
/// or device memory for a state over a device backend).
template <class T, class Space = host_space>
struct kfac_grad {
  tensor_view<T, Space> weight;     ///< out × in
  tensor_view<T, Space> bias = {};  ///< out (empty without a bias)
};

namespace detail {
template <class G>
struct is_kfac_grad : std::false_type {};
template <class T, class Space>
struct is_kfac_grad<kfac_grad<T, Space>> : std::bool_constant<element<T>> {};
/// A contiguous range of kfac_grad<T, Space> (an array, std::vector, std::span).
template <class R>
concept kfac_grad_range = std::ranges::contiguous_range<const R> && std::ranges::sized_range<const R> &&
    is_kfac_grad<std::remove_cv_t<std::ranges::range_value_t<R>>>::value;

}  // namespace detail

/// Options of `gradapt::kfac` (defaults: kfac-pytorch's KFACPreconditioner, except
/// prediv_eigenvalues, which kfac-pytorch switches on; the results are the same either way).
struct kfac_options {
  /// d of the running averages, in (0, 1]. Default 0.95.
  double factor_decay = 0.95;
  /// Update the factors at steps t with (t − 1) mod this == 0 (>= 1). Default 1.
  std::uint64_t factor_update_steps = 1;
  /// Recompute the decompositions at steps t with (t − 1) mod this == 0 (>= 1). Default 1.
  std::uint64_t inv_update_steps = 1;
  /// λ, finite and >= 0 (Tikhonov). Default 0.001.
  double damping = 0.001;
  /// Eigendecompositions or damped inverses. Default eigen.
  kfac_method method = kfac_method::eigen;
  /// eigen: keep 1 / (d_G·d_Aᵀ + λ) from the inverse update instead of the eigenvalues (one
  /// out × in matrix per layer; the step divides nothing). Default false.
  bool prediv_eigenvalues = false;
  /// KL clipping's bound, finite and >= 0; 0 switches it off. Default 0.001.
  double kl_clip = 0.001;
  /// A layer whose decomposition fails this many inverse updates in a row makes the step throw
  /// (>= 1). Default 10.
  std::uint64_t max_consecutive_failures = 10;
  /// KAISA's grad_worker_fraction, in (0, 1]: on n ranks each layer has g = max(1,
  /// round(fraction · n)) grad workers (g must divide n), the group of g consecutive ranks that
  /// holds the rank decomposing it. They hold its decomposition and precondition its gradient.
  /// 1: every rank holds every decomposition (communication-optimal); 1/n: only the decomposing
  /// rank (memory-optimal; the preconditioned gradients are allgathered every step); in between,
  /// hybrid. Every choice gives the same bits. Default 1.
  double grad_worker_fraction = 1;
};

}  // namespace gradapt
