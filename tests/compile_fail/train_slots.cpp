// The composed step's invalid slot combinations: this file must NOT compile, and the
// compiler's output must hold every line marked "expect:" below (tests/compile_fail/check.cmake,
// ctest compile_fail_train_slots). Each function builds one combination that a static_assert of
// train::data_parallel_step rejects, naming both slots.
#include "gradapt/backend/host.hpp"
#include "gradapt/comm/single.hpp"
#include "gradapt/optim/sgd.hpp"
#include "gradapt/optim/shampoo.hpp"
#include "gradapt/train/data_parallel_step.hpp"

namespace gt = gradapt::train;
using list = gradapt::param_list<float, float>;

// expect: the combine slot's adasum_combine (or a user's combiner) forms something else: use allreduce_mean
void zero_with_adasum(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::zero_state<1>{}, gt::adasum_combine{});
}
// expect: the sync slot's local_sgd_policy steps each replica alone on its local steps
void zero_with_local_sgd(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::zero_state<1>{},
                                    gt::local_sgd_policy{{}, gradapt::fixed_period({.period = 4})});
}
// expect: for buckets with sharded state use zero_state<2> (its sharding.buckets) without bucket_reduce
void buckets_with_zero(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::zero_state<1>{}, gt::bucket_reduce{});
}
// expect: the combine slot's adasum_combine (or a user's combiner) forms something else: use allreduce_mean
void buckets_with_adasum(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::bucket_reduce{}, gt::adasum_combine{});
}
// expect: the sync slot's local_sgd_policy steps each replica alone on its local steps
void buckets_with_local_sgd(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::bucket_reduce{},
                                    gt::local_sgd_policy{{}, gradapt::fixed_period({.period = 4})});
}
// expect: Adasum has a hierarchical mode of its own
void hierarchy_with_adasum(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::hierarchical_reduce{},
                                    gt::adasum_combine{});
}
// expect: the reduce slot's hierarchical_reduce allreduces whole gradients: use one of the two
void hierarchy_with_zero(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::hierarchical_reduce{},
                                    gt::zero_state<2>{});
}
// expect: more than one policy for one slot
// expect: slot::state
void two_state_policies(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  (void)gt::make_data_parallel_step(c, b, p, gradapt::sgd(), {}, gt::zero_state<1>{}, gt::replicated_state{});
}
// expect: is sharded by block, and its later stages may not take per-tensor or global sums
void clipped_shampoo_with_zero(gradapt::comm::single& c, const gradapt::host& b, const list& p) {
  using clipped =
      gradapt::chain<gradapt::transform::scale_by_shampoo<>, gradapt::transform::clip_by_global_norm,
                     gradapt::transform::scale_by_learning_rate>;
  (void)gt::make_data_parallel_step(c, b, p, clipped{}, {}, gt::zero_state<2>{});
}
// expect: stage 3 (sharded parameters) is not offered
[[maybe_unused]] gt::zero_state<3> stage_three;
