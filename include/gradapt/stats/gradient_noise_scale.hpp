#pragma once
/// @file
/// Gradient noise scale estimator (McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model
/// of Large-Batch Training", appendix A.1).
///
/// Notation. Per-example gradients g_i have mean G and covariance Σ. The mean gradient of a
/// batch of B independent examples, g_B, satisfies
///
///     E|g_B|^2 = |G|^2 + tr(Σ) / B.
///
/// Two batch sizes B_small < B_big give two equations in two unknowns, hence the unbiased
/// estimators
///
///     |G|^2 ≈ (B_big |g_big|^2 − B_small |g_small|^2) / (B_big − B_small)
///     tr(Σ) ≈ (|g_small|^2 − |g_big|^2) / (1/B_small − 1/B_big)
///
/// and the "simple" noise scale B_simple = tr(Σ) / |G|^2, the batch size beyond which larger
/// batches stop paying off. Both single estimates are noisy (and may be negative); they are
/// smoothed by exponential moving averages kept apart, and B_simple is the ratio of the two
/// bias-corrected averages (a ratio of averages, not an average of ratios).
///
/// Every gradient here is the MEAN over the examples of the batch it represents (not the sum).

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "gradapt/backend/concepts.hpp"
#include "gradapt/comm/agree.hpp"
#include "gradapt/core/archive.hpp"
#include "gradapt/core/concepts.hpp"
#include "gradapt/core/config.hpp"
#include "gradapt/core/configured.hpp"
#include "gradapt/core/detail/archive_fields.hpp"
#include "gradapt/core/error.hpp"
#include "gradapt/core/ops.hpp"
#include "gradapt/core/param_list.hpp"
#include "gradapt/core/tensor_view.hpp"

namespace gradapt {

/// Hyperparameters of gradient_noise_scale, e.g.
/// `gradapt::gradient_noise_scale_options{.smoothing = 0.99}`.
///
/// | name      | type   | default | meaning                                                   |
/// |-----------|--------|---------|-----------------------------------------------------------|
/// | smoothing | double | 0.99    | EMA factor β in [0, 1); 0 keeps only the latest estimate  |
struct gradient_noise_scale_options {
  double smoothing = 0.99;  ///< β of the EMAs: avg ← β avg + (1 − β) estimate
};

/// How many examples one rank's gradient represents, and the loss scale it carries.
///
/// The local batch is `micro_batch × accumulation_steps` (gradient accumulation counts in).
/// Gradients (and hence the squared norms passed in) may be multiplied by `loss_scale`, as
/// with dynamic loss scaling in mixed precision: squared norms are divided by loss_scale^2 and
/// dot products by loss_scale before use.
struct noise_batch {
  double micro_batch = 0.0;    ///< examples per micro-batch on one rank (> 0)
  int accumulation_steps = 1;  ///< micro-batches accumulated into one local gradient (>= 1)
  double loss_scale = 1.0;     ///< factor the gradients carry (> 0, finite)

  /// Examples behind one rank's gradient: micro_batch × accumulation_steps.
  double local() const { return micro_batch * static_cast<double>(accumulation_steps); }
};

/// One pair of single-sample estimates (|G|^2, tr(Σ)); unbiased for the two-batch forms.
struct noise_scale_estimate {
  double grad_sq = 0.0;  ///< estimate of |G|^2, the squared norm of the true gradient
  double trace = 0.0;    ///< estimate of tr(Σ), the per-example gradient covariance trace
};

/// The complete state of a gradient_noise_scale: plain data, copied bit for bit by save/load.
struct gradient_noise_scale_state {
  double ema_grad_sq = 0.0;   ///< biased EMA of the |G|^2 estimates
  double ema_trace = 0.0;     ///< biased EMA of the tr(Σ) estimates
  double beta_power = 1.0;    ///< β^t for t accepted samples (bias correction 1 − β^t)
  double last_grad_sq = 0.0;  ///< latest accepted |G|^2 estimate (unsmoothed)
  double last_trace = 0.0;    ///< latest accepted tr(Σ) estimate (unsmoothed)
  std::uint64_t samples = 0;  ///< accepted samples t
  std::uint64_t skipped = 0;  ///< samples skipped because a norm or estimate was not finite
  std::uint64_t biased = 0;   ///< accepted samples that came from the single-replica form
  bool has_previous = false;  ///< single-replica backend form: the previous-gradient buffer holds g_{t-1}

  /// The fields in the checkpoint (archive names and members), read by put_fields/get_fields.
  static constexpr auto archive_fields() {
    return GRADAPT_ARCHIVE_FIELDS(gradient_noise_scale_state, ema_grad_sq, ema_trace, beta_power,
                                  last_grad_sq, last_trace, samples, skipped, biased, has_previous);
  }
};

namespace detail::gns {

inline void check_batch_size(double b, const char* fn, const char* what) {
  require(std::isfinite(b) && b > 0.0, fn, ": ", what, " is ", b,
          " (expected a positive, finite batch size)");
}

inline void check_loss_scale(double s, const char* fn) {
  require(std::isfinite(s) && s > 0.0, fn, ": loss_scale is ", s,
          " (expected a positive, finite factor; pass 1 without loss scaling)");
}

inline void check_noise_batch(const noise_batch& b, const char* fn) {
  check_batch_size(b.micro_batch, fn, "micro_batch");
  require(b.accumulation_steps >= 1, fn, ": accumulation_steps is ", b.accumulation_steps,
          " (expected >= 1; 1 without gradient accumulation)");
  check_loss_scale(b.loss_scale, fn);
}

/// Finite negative squared norms are caller bugs; inf and NaN are skipped samples instead.
inline void check_squared_norm(double v, const char* fn, const char* what) {
  require(!(v < 0.0), fn, ": ", what, " is ", v, " (a squared norm must be >= 0; pass the sum of squares)");
}

/// Functor of the single-replica backend form: previous = gradient / loss_scale.
struct store_unscaled {
  double inv_scale;
  template <class P, class G>
  GRADAPT_HD void operator()(P& previous, G grad) const {
    previous = static_cast<P>(static_cast<double>(grad) * inv_scale);
  }
};

}  // namespace detail::gns

/// The two-batch estimator of McCandlish et al. (2018), appendix A.1:
///
///     |G|^2 ≈ (B_big |g_big|^2 − B_small |g_small|^2) / (B_big − B_small)
///     tr(Σ) ≈ (|g_small|^2 − |g_big|^2) / (1/B_small − 1/B_big)
///
/// Both are unbiased when g_small and g_big are means over B_small and B_big independent
/// examples (g_big may contain g_small's examples: only E|g_B|^2 = |G|^2 + tr(Σ)/B is used).
/// Inputs are not validated here and non-finite inputs give non-finite results; use
/// gradient_noise_scale for a validated, smoothed estimator.
///
/// @param small_sq |g_small|^2   @param b_small B_small
/// @param big_sq   |g_big|^2     @param b_big   B_big (> B_small)
inline noise_scale_estimate two_batch_estimate(double small_sq, double b_small, double big_sq, double b_big) {
  return {(b_big * big_sq - b_small * small_sq) / (b_big - b_small),
          (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)};
}

/// Smoothed gradient noise scale B_simple = tr(Σ) / |G|^2 (McCandlish et al. 2018).
///
/// Feed one estimate per step through one of the entry points:
///  - `update(small_sq, b_small, big_sq, b_big)`: the serial two-batch form;
///  - `update(comm, local_sq, global_sq, batch)`: the data-parallel form. Each rank passes the
///    squared norm of its own gradient taken BEFORE the gradient allreduce (B_small = local
///    batch) and the squared norm of the rank-averaged gradient (B_big = ranks × local batch).
///    |g_small|^2 is the mean of the ranks' local squared norms, obtained with one extra scalar
///    allreduce on the communicator;
///  - `update_reduced(mean_local_sq, global_sq, ranks, batch)`: the same, for a caller that
///    fused the sum of local squared norms into its own communication (or uses a device
///    communicator);
///  - `update_single_replica(...)`: one replica, no second batch size. The current and previous
///    steps' gradients g_t, g_{t−1} (batch B each) are treated as two independent small
///    batches: |g_small|^2 = (|g_t|^2 + |g_{t−1}|^2)/2 with B_small = B, and
///    |g_big|^2 = |(g_t + g_{t−1})/2|^2 = (|g_t|^2 + |g_{t−1}|^2 + 2 g_t·g_{t−1})/4 with
///    B_big = 2B. This is BIASED: the parameters move between the steps, so the two gradients
///    do not share one mean; the drift G_t − G_{t−1} is counted as noise and tr(Σ) tends to be
///    overestimated. Such samples are counted in `biased_samples()`.
///
/// Smoothing: the |G|^2 and tr(Σ) estimates enter separate EMAs with factor β,
/// avg_t = β avg_{t−1} + (1 − β) x_t, reported bias-corrected as avg_t / (1 − β^t).
/// Negative single estimates enter unchanged (they are unbiased; clamping would bias).
///
/// Robustness: a sample whose norms or estimates are not finite (inf/NaN, e.g. an fp16
/// overflow) is skipped and counted in `skipped()`; it never reaches the averages. Invalid
/// arguments (non-positive batches, B_big <= B_small, negative squared norms, bad loss scale)
/// throw gradapt::error.
///
/// The state is a plain struct (`state()`, `restore()`); `save()` / `load()` carry it in a
/// state archive and restore the estimator exactly.
class gradient_noise_scale
    : public archived_state<gradient_noise_scale, gradient_noise_scale_state>,
      public configured<gradient_noise_scale, gradient_noise_scale_options, gradient_noise_scale_state> {
 public:
  /// `gradient_noise_scale(options)` (throws gradapt::error when smoothing is outside [0, 1))
  /// and `gradient_noise_scale({})` (the default options).
  using configured::configured;

  /// The options given at construction (fixed for the estimator's lifetime).
  const gradient_noise_scale_options& options() const { return opt_; }

  /// Serial two-batch form: |g_small|^2 over B_small examples and |g_big|^2 over B_big.
  /// Squared norms are divided by loss_scale^2.
  /// @return true when the sample was accepted, false when it was skipped (not finite)
  bool update(double small_sq, double b_small, double big_sq, double b_big, double loss_scale = 1.0) {
    constexpr const char* fn = "gradient_noise_scale::update";
    detail::gns::check_batch_size(b_small, fn, "B_small");
    detail::gns::check_batch_size(b_big, fn, "B_big");
    detail::require(b_big > b_small, fn, ": B_big is ", b_big, " but B_small is ", b_small,
                    " (expected B_big > B_small: the large batch must hold more examples)");
    detail::gns::check_loss_scale(loss_scale, fn);
    detail::gns::check_squared_norm(small_sq, fn, "|g_small|^2");
    detail::gns::check_squared_norm(big_sq, fn, "|g_big|^2");
    const double s2 = loss_scale * loss_scale;
    return accept(two_batch_estimate(small_sq / s2, b_small, big_sq / s2, b_big), false);
  }

  /// Data-parallel form over a host communicator: one scalar allreduce (sum) of the local
  /// squared norms, then `update_reduced(sum / ranks, global_sq, ranks, batch)`. Collective:
  /// every rank calls it with the same batch (all ranks hold equal local batches). Input
  /// errors found on any rank are agreed on through the same allreduce (a second double
  /// carries an error flag), so every rank throws and none is left waiting.
  ///
  /// @param comm      the data-parallel communicator (host memory, >= 2 ranks); its size is the
  ///                  number of replicas whose local batches make up the big batch
  /// @param local_sq  |g_local|^2 of this rank's gradient before the gradient allreduce
  /// @param global_sq |g|^2 of the rank-averaged gradient (the same on every rank)
  /// @param batch     local batch (micro_batch × accumulation_steps) and loss scale
  template <communicator C>
  requires std::same_as<typename C::space, host_space>
  bool update(C& comm, double local_sq, double global_sq, const noise_batch& batch) {
    const int ranks = comm.size();
    std::string local_error;
    try {
      detail::require(ranks >= 2, "gradient_noise_scale::update on rank ", comm.rank(),
                      ": a world of 1 rank has no second batch size (use update_single_replica, or "
                      "the serial update with two batch sizes)");
      detail::gns::check_noise_batch(batch, "gradient_noise_scale::update");
      detail::gns::check_squared_norm(local_sq, "gradient_noise_scale::update", "local |g|^2");
      detail::gns::check_squared_norm(global_sq, "gradient_noise_scale::update", "global |g|^2");
    } catch (const error& e) {
      local_error = e.what();
    }
    double buf[2] = {local_error.empty() ? local_sq : 0.0, local_error.empty() ? 0.0 : 1.0};
    comm.allreduce(tensor_view<double, host_space>::vector(buf, 2), reduce_op::sum);
    if (!local_error.empty()) throw error(local_error);
    detail::require(buf[1] == 0.0, "gradient_noise_scale::update on rank ", comm.rank(), ": ", buf[1],
                    " other rank(s) passed invalid input (see the error raised on those ranks)");
    // The batch description and the averaged gradient's norm must be the same everywhere, or
    // the ranks would hold different estimates.
    agree_values(comm, "gradient_noise_scale::update",
                 {{"noise_batch::micro_batch", batch.micro_batch},
                  {"noise_batch::accumulation_steps", static_cast<double>(batch.accumulation_steps)},
                  {"noise_batch::loss_scale", batch.loss_scale},
                  {"global |g|^2", global_sq}});
    return update_reduced(buf[0] / static_cast<double>(ranks), global_sq, ranks, batch);
  }

  /// Data-parallel form from the norms of a summing gradient allreduce
  /// (`gradapt::allreduce_with_norms`, or a communicator's own `allreduce_with_norms`): the mean
  /// local squared norm is norms.sum_local_sq / ranks and the squared norm of the averaged
  /// gradient is norms.result_sq / ranks^2. Not collective: every rank holds the same norms.
  bool update(const allreduce_norms& norms, int ranks, const noise_batch& batch) {
    detail::require(ranks >= 2, "gradient_noise_scale::update(allreduce_norms): ranks is ", ranks,
                    " (expected >= 2; with one replica use update_single_replica)");
    const double p = static_cast<double>(ranks);
    return update_reduced(norms.sum_local_sq / p, norms.result_sq / (p * p), ranks, batch);
  }

  /// Data-parallel form with the reduction done by the caller (fused into its own
  /// communication): `mean_local_sq` is the mean over ranks of the local squared norms.
  /// B_small = batch.local(), B_big = ranks × batch.local(); norms divided by loss_scale^2.
  bool update_reduced(double mean_local_sq, double global_sq, int ranks, const noise_batch& batch) {
    constexpr const char* fn = "gradient_noise_scale::update_reduced";
    detail::require(ranks >= 2, fn, ": ranks is ", ranks,
                    " (expected >= 2; with one replica use update_single_replica)");
    detail::gns::check_noise_batch(batch, fn);
    detail::gns::check_squared_norm(mean_local_sq, fn, "mean local |g|^2");
    detail::gns::check_squared_norm(global_sq, fn, "global |g|^2");
    const double s2 = batch.loss_scale * batch.loss_scale;
    const double b_small = batch.local();
    return accept(
        two_batch_estimate(mean_local_sq / s2, b_small, global_sq / s2, static_cast<double>(ranks) * b_small),
        false);
  }

  /// Single-replica (differenced) form from scalars that are already unscaled:
  /// |g_t|^2, |g_{t−1}|^2, g_t·g_{t−1}, each gradient a mean over `batch_size` examples.
  /// The sample is flagged biased (see the class comment).
  bool update_single_replica(double sq_current, double sq_previous, double dot, double batch_size) {
    constexpr const char* fn = "gradient_noise_scale::update_single_replica";
    detail::gns::check_batch_size(batch_size, fn, "batch_size");
    detail::gns::check_squared_norm(sq_current, fn, "|g_t|^2");
    detail::gns::check_squared_norm(sq_previous, fn, "|g_{t-1}|^2");
    const double small_sq = 0.5 * (sq_current + sq_previous);
    const double big_sq = 0.25 * (sq_current + sq_previous + 2.0 * dot);
    return accept(two_batch_estimate(small_sq, batch_size, big_sq, 2.0 * batch_size), true);
  }

  /// Single-replica form computed through the backend. `previous` is a caller-owned list of
  /// buffers (one per gradient tensor, same sizes, float or double preferred) that holds the
  /// previous step's UNSCALED gradient; this call computes |g_t|^2 / s^2, |g_{t−1}|^2 and
  /// g_t·g_{t−1} / s (s = batch.loss_scale, batch = batch.local()), feeds the sample, and then
  /// stores g_t / s into `previous`. The first call (and the call after a skipped one) only
  /// fills `previous` and returns false without counting a skip. A non-finite norm or dot is
  /// skipped and counted, and `previous` is marked stale rather than overwritten.
  template <backend B, class L, class P>
  bool update_single_replica(const B& b, const L& grads, const P& previous, const noise_batch& batch) {
    constexpr const char* fn = "gradient_noise_scale::update_single_replica";
    detail::gns::check_noise_batch(batch, fn);
    detail::require(std::ranges::size(grads) == std::ranges::size(previous), fn, ": ",
                    std::ranges::size(grads), " gradient tensors but ", std::ranges::size(previous),
                    " previous-gradient buffers (expected one buffer per gradient tensor)");
    const double s = batch.loss_scale;
    const double sq = b.reduce(reduction::sum_squares, grads, std::span<double>{}) / (s * s);
    if (!std::isfinite(sq)) {
      ++st_.skipped;
      st_.has_previous = false;
      return false;
    }
    bool accepted = false;
    if (st_.has_previous) {
      const double sq_prev = b.reduce(reduction::sum_squares, previous, std::span<double>{});
      const double dot = b.dot(grads, previous, std::span<double>{}) / s;
      if (!std::isfinite(sq_prev) || !std::isfinite(dot)) {
        ++st_.skipped;
        st_.has_previous = false;
        return false;
      }
      accepted = update_single_replica(sq, sq_prev, dot, batch.local());
    }
    b.apply_list(detail::gns::store_unscaled{1.0 / s}, previous, grads);
    st_.has_previous = true;
    return accepted;
  }

  /// Feeds one estimate pair directly (e.g. computed elsewhere). `biased` marks samples that do
  /// not come from an unbiased two-batch form. Non-finite pairs are skipped and counted.
  bool accept(noise_scale_estimate e, bool biased) {
    const double beta = opt_.smoothing;
    const double g = beta * st_.ema_grad_sq + (1.0 - beta) * e.grad_sq;
    const double t = beta * st_.ema_trace + (1.0 - beta) * e.trace;
    if (!std::isfinite(e.grad_sq) || !std::isfinite(e.trace) || !std::isfinite(g) || !std::isfinite(t)) {
      ++st_.skipped;
      return false;
    }
    st_.ema_grad_sq = g;
    st_.ema_trace = t;
    st_.beta_power *= beta;
    st_.last_grad_sq = e.grad_sq;
    st_.last_trace = e.trace;
    ++st_.samples;
    if (biased) ++st_.biased;
    return true;
  }

  /// Bias-corrected EMA of |G|^2: avg / (1 − β^t); std::nullopt before the first sample.
  std::optional<double> grad_sq() const {
    if (st_.samples == 0) return std::nullopt;
    return st_.ema_grad_sq / (1.0 - st_.beta_power);
  }

  /// Bias-corrected EMA of tr(Σ) (per-example covariance trace); std::nullopt before the first
  /// sample. May be negative early on (unbiased single estimates are noisy).
  std::optional<double> trace() const {
    if (st_.samples == 0) return std::nullopt;
    return st_.ema_trace / (1.0 - st_.beta_power);
  }

  /// B_simple = trace() / grad_sq(), the critical batch-size proxy of McCandlish et al.
  /// std::nullopt before the first sample and whenever the smoothed |G|^2 is not > 0 (the
  /// ratio is undefined or meaningless there). The value may be negative while the smoothed
  /// tr(Σ) is still negative (too few samples).
  std::optional<double> b_simple() const {
    const auto g = grad_sq();
    if (!g || !(*g > 0.0)) return std::nullopt;
    return *trace() / *g;
  }

  /// The latest accepted unsmoothed estimate pair (zeros before the first sample).
  noise_scale_estimate last() const { return {st_.last_grad_sq, st_.last_trace}; }
  /// Accepted samples so far (both forms, biased ones included).
  std::uint64_t samples() const { return st_.samples; }
  /// Samples rejected because a norm or estimate was not finite (inf/NaN); they never reached
  /// the averages.
  std::uint64_t skipped() const { return st_.skipped; }
  /// Accepted samples from the single-replica (biased) form.
  std::uint64_t biased_samples() const { return st_.biased; }
  /// True when any accepted sample came from the biased single-replica form.
  bool biased() const { return st_.biased > 0; }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.gradient_noise_scale";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The complete state (plain data).
  const gradient_noise_scale_state& state() const { return st_; }
  /// Sets the state; later results are bit-identical to the run it was taken from.
  /// @throws gradapt::error when the state is inconsistent (non-finite averages or estimates,
  ///         β^t outside [0, 1], counters that disagree or would overflow); state unchanged
  void restore(const gradient_noise_scale_state& s) {
    constexpr auto top = std::numeric_limits<std::uint64_t>::max();
    const auto finite = [](const char* field, double v) {
      detail::require(std::isfinite(v), "gradient_noise_scale::load: field ", field, " is ", v,
                      " (expected a finite value)");
    };
    finite("ema_grad_sq", s.ema_grad_sq);
    finite("ema_trace", s.ema_trace);
    finite("last_grad_sq", s.last_grad_sq);
    finite("last_trace", s.last_trace);
    detail::require(s.beta_power >= 0.0 && s.beta_power <= 1.0 && ((s.samples == 0) == (s.beta_power == 1.0)),
                    "gradient_noise_scale::load: field beta_power is ", s.beta_power, " with samples ",
                    s.samples, " (expected beta_power = 1 with no samples and in [0, 1) otherwise)");
    detail::require(s.samples < top && s.skipped < top, "gradient_noise_scale::load: field samples is ",
                    s.samples, " and skipped ", s.skipped, " (cannot grow)");
    detail::require(s.biased <= s.samples, "gradient_noise_scale::load: field biased is ", s.biased,
                    " with samples ", s.samples, " (expected biased <= samples)");
    st_ = s;
  }

  /// Forgets all samples (options kept).
  void reset() { st_ = {}; }

 private:
  friend class configured<gradient_noise_scale, gradient_noise_scale_options, gradient_noise_scale_state>;

  static constexpr std::string_view name = "gradient_noise_scale";

  static gradient_noise_scale_options validated(const gradient_noise_scale_options& o) {
    detail::require(std::isfinite(o.smoothing) && o.smoothing >= 0.0 && o.smoothing < 1.0,
                    "gradient_noise_scale: smoothing is ", o.smoothing,
                    " (expected 0 <= smoothing < 1; 0.99 is typical)");
    return o;
  }
  static gradient_noise_scale_state start(const gradient_noise_scale_options&) { return {}; }
};

/// Noise scale per parameter group and globally, from a param_list's gradients.
///
/// Slot 0 is the whole model; slot 1 + g is group g of the param_list (its members' squared
/// norms summed in member order). Squared norms come from the backend's per-tensor
/// `reduce(reduction::sum_squares, grads, per_tensor)`, accumulated in double whatever the
/// gradient type (fp16/bf16 gradients included). Each slot is a gradient_noise_scale with the
/// same options, updated and skipped independently.
///
/// Data-parallel use, each step:
///     gns.record_local(backend, params);         // before the gradient allreduce
///     /* allreduce-mean the gradients */
///     gns.update(comm, backend, params, batch);  // one allreduce of (groups + 1) doubles
/// or `update_reduced` with reductions the caller fused into its own communication.
/// Buffers are sized at construction; steps allocate nothing. Argument checks in `update` run
/// before its collective and use only values that are equal on every rank by contract (rank
/// count, batch, tensor and group counts, whether record_local was called).
class grouped_noise_scale {
 public:
  /// Sizes the estimator for `params` (its tensor and group counts must not change later).
  template <element V, element G, memory_space S, class O>
  grouped_noise_scale(gradient_noise_scale_options options, const param_list<V, G, S, O>& params)
      : tensors_(params.size()),
        est_(params.group_count() + 1, gradient_noise_scale(options)),
        per_tensor_(params.size()),
        local_(params.group_count() + 1),
        global_(params.group_count() + 1) {}

  /// Number of slots: groups + 1.
  std::size_t slots() const { return est_.size(); }
  /// The whole-model estimator (slot 0): norms summed over every tensor of the list.
  const gradient_noise_scale& global() const { return est_[0]; }
  /// The estimator of group g.
  const gradient_noise_scale& group(std::size_t g) const {
    detail::require(g + 1 < est_.size(), "grouped_noise_scale::group: index ", g, " out of range (",
                    est_.size() - 1, " group(s))");
    return est_[g + 1];
  }

  /// Squared norms (raw: loss scale not removed) of the whole gradient and of each group into
  /// `out` (slots() entries: out[0] global, out[1 + g] group g).
  template <backend B, element V, element G, memory_space S, class O>
  void measure(const B& b, const param_list<V, G, S, O>& params, std::span<double> out) {
    check_params(params, "measure");
    detail::require(out.size() == est_.size(), "grouped_noise_scale::measure: out has ", out.size(),
                    " slots (expected ", est_.size(), " = groups + 1)");
    out[0] = b.reduce(reduction::sum_squares, params.grads(), std::span<double>(per_tensor_));
    for (std::size_t g = 0; g + 1 < est_.size(); ++g) {
      double s = 0.0;
      for (std::size_t m : params.group(g).members) s += per_tensor_[m];
      out[g + 1] = s;
    }
  }

  /// Records this rank's local squared norms; call before the gradient allreduce.
  template <backend B, element V, element G, memory_space S, class O>
  void record_local(const B& b, const param_list<V, G, S, O>& params) {
    measure(b, params, std::span<double>(local_));
    recorded_ = true;
  }

  /// After the gradient allreduce (gradients are the rank mean): measures the averaged
  /// gradient's squared norms, sums the recorded local norms over ranks with ONE allreduce of
  /// slots() doubles, and updates every slot (`gradient_noise_scale::update_reduced`).
  /// @return true when the global slot accepted its sample
  template <communicator C, backend B, element V, element G, memory_space S, class O>
  requires std::same_as<typename C::space, host_space>
  bool update(C& comm, const B& b, const param_list<V, G, S, O>& params, const noise_batch& batch) {
    detail::require(recorded_, "grouped_noise_scale::update on rank ", comm.rank(),
                    ": no local norms recorded this step (call record_local before the gradient allreduce)");
    detail::require(comm.size() >= 2, "grouped_noise_scale::update on rank ", comm.rank(),
                    ": a world of 1 rank has no second batch size (expected >= 2 ranks)");
    detail::gns::check_noise_batch(batch, "grouped_noise_scale::update");
    measure(b, params, std::span<double>(global_));
    comm.allreduce(host_view(local_), reduce_op::sum);
    recorded_ = false;
    const double n = static_cast<double>(comm.size());
    for (double& v : local_) v /= n;
    return update_slots(local_, global_, comm.size(), batch);
  }

  /// The same with reductions done by the caller: `mean_local[k]` is the rank mean of the local
  /// squared norms of slot k, `global[k]` the averaged gradient's squared norm of slot k.
  bool update_reduced(std::span<const double> mean_local, std::span<const double> global, int ranks,
                      const noise_batch& batch) {
    detail::require(mean_local.size() == est_.size() && global.size() == est_.size(),
                    "grouped_noise_scale::update_reduced: ", mean_local.size(), " local and ", global.size(),
                    " global norms (expected ", est_.size(), " each = groups + 1)");
    for (std::size_t k = 0; k < est_.size(); ++k) {
      detail::gns::check_squared_norm(mean_local[k], "grouped_noise_scale::update_reduced",
                                      "mean local |g|^2");
      detail::gns::check_squared_norm(global[k], "grouped_noise_scale::update_reduced", "global |g|^2");
    }
    return update_slots(mean_local, global, ranks, batch);
  }

  /// Kind and format version of the archive `save()` writes.
  static constexpr std::string_view archive_kind = "gradapt.grouped_noise_scale";
  static constexpr std::uint32_t archive_version = 1;  ///< see archive_kind

  /// The estimator of slot k (0 is the whole model, 1 + g group g).
  const gradient_noise_scale& slot(std::size_t k) const {
    detail::require(k < est_.size(), "grouped_noise_scale::slot: index ", k, " out of range (", est_.size(),
                    " slots)");
    return est_[k];
  }
  /// Writes the slot count and every slot's state (sections "slot<k>") into `w`.
  void save(archive_writer& w) const {
    w.put("slots", static_cast<std::uint64_t>(est_.size()));
    for (std::size_t k = 0; k < est_.size(); ++k) {
      w.begin(detail::archive_impl::join("slot", "", std::to_string(k)));
      est_[k].save(w);
      w.end();
    }
  }
  /// Reads what `save(archive_writer&)` wrote; all or nothing.
  void load(archive_reader& r) {
    const auto n = r.get<std::uint64_t>("slots");
    detail::require(n == est_.size(), "grouped_noise_scale::load: ", n, " slots in the checkpoint for ",
                    est_.size(), " here (expected groups + 1)");
    std::vector<gradient_noise_scale> next = est_;
    for (std::size_t k = 0; k < est_.size(); ++k) {
      r.begin(detail::archive_impl::join("slot", "", std::to_string(k)));
      next[k].load(r);
      r.end();
    }
    r.finish_section();
    est_ = std::move(next);
  }
  /// Every slot's state as one archive of kind "gradapt.grouped_noise_scale".
  std::vector<std::byte> save() const { return save_archive(*this); }
  /// Restores the slots from `save()`; all or nothing.
  void load(std::span<const std::byte> bytes) { load_archive(*this, bytes); }

 private:
  template <class PL>
  void check_params(const PL& params, const char* fn) const {
    detail::require(params.size() == tensors_ && params.group_count() + 1 == est_.size(),
                    "grouped_noise_scale::", fn, ": parameter list has ", params.size(), " tensors in ",
                    params.group_count(), " group(s) but the estimator was built for ", tensors_,
                    " tensors in ", est_.size() - 1,
                    " (build a new estimator when the parameter list changes)");
  }

  bool update_slots(std::span<const double> mean_local, std::span<const double> global, int ranks,
                    const noise_batch& batch) {
    bool ok = false;
    for (std::size_t k = 0; k < est_.size(); ++k) {
      const bool r = est_[k].update_reduced(mean_local[k], global[k], ranks, batch);
      if (k == 0) ok = r;
    }
    return ok;
  }

  std::size_t tensors_;
  std::vector<gradient_noise_scale> est_;
  std::vector<double> per_tensor_;
  std::vector<double> local_;
  std::vector<double> global_;
  bool recorded_ = false;
};

}  // namespace gradapt
