#pragma once
// The Shampoo family (optim/shampoo.hpp: Shampoo, SOAP, Muon) in the composed step, as rows of
// the covering array of
// train_combinations.hpp (same recipe, reference and checks): the replicated state slot with
// each reduce slot (one buffer, buckets, hierarchical), each combine slot (mean, Adasum), the
// loss scaler, AdaScale and LocalSGD, and the ZeRO state slots (sharded by block: each rank
// holds the rows of blocks of its shard and computes their roots). With replicated state and
// without LocalSGD the step divides the roots among the ranks (chain::step(comm, ...)); with
// LocalSGD each rank computes its own.
// Needs LAPACK (gradapt::linalg).
#include "gradapt/optim/shampoo.hpp"
#include "scenarios/train_combinations.hpp"

namespace train_combinations_scenario {

/// Shampoo with roots every 3 steps from step 2 (several root computations within a row, one
/// of them just before the save), AdaGrad grafting, a first moment, momentum and weight decay.
inline const auto shampoo = gradapt::shampoo({.lr = 2e-2,
                                              .max_preconditioner_dim = 16,
                                              .precondition_frequency = 3,
                                              .start_preconditioning_step = 2,
                                              .beta1 = 0.9,
                                              .graft = gradapt::shampoo_graft::adagrad,
                                              .momentum = 0.9,
                                              .weight_decay = 1e-3});

/// SOAP (eigenvalue-corrected Shampoo with QR refreshes) with eigenbases refreshed every 3 steps.
inline const auto soap = gradapt::shampoo([] {
  gradapt::shampoo_options o = gradapt::soap_defaults();
  o.lr = 1e-2;
  o.max_preconditioner_dim = 16;  // the peer's 1024 makes the 1-D tensors' blocks 1024 × 1024
  o.beta2 = 0.99;
  o.root.epsilon = 1e-8;
  o.precondition_frequency = 3;
  o.start_preconditioning_step = 3;
  o.weight_decay = 1e-3;
  return o;
}());

/// Muon through spectral descent: 2-D blocks orthogonalized (aspect-scaled), the others by Adam.
inline const auto muon = gradapt::shampoo([] {
  gradapt::shampoo_options o = gradapt::spectral_descent_defaults();
  o.lr = 2e-2;
  o.max_preconditioner_dim = 16;
  o.scale_by_aspect = true;
  o.graft = gradapt::shampoo_graft::adam;
  o.graft_beta2 = 0.95;
  o.momentum = 0.9;
  o.nesterov = true;
  return o;
}());

template <class Row>
void shampoo_rows(Row&& row) {
  row("shampoo, buckets, scaler", flags<true, false, false>{}, shampoo, replicated_state{}, buckets,
      allreduce_mean{});
  row("shampoo, hierarchical, AdaScale, LocalSGD", flags<false, true, true>{}, shampoo, replicated_state{},
      pairs, allreduce_mean{});
  row("shampoo, one buffer, AdaScale", flags<false, true, false>{}, shampoo, replicated_state{},
      one_buffer_reduce{}, allreduce_mean{});
  row("shampoo, Adasum, scaler, LocalSGD", flags<true, false, true>{}, shampoo, replicated_state{},
      one_buffer_reduce{}, adasum{});
  row("shampoo, hierarchical by host, scaler", flags<true, false, false>{}, shampoo, replicated_state{}, hier,
      allreduce_mean{});
  row("soap, one buffer, scaler", flags<true, false, false>{}, soap, replicated_state{}, one_buffer_reduce{},
      allreduce_mean{});
  row("muon, buckets, AdaScale", flags<false, true, false>{}, muon, replicated_state{}, buckets,
      allreduce_mean{});
  // Sharded by block: each rank holds and steps its rows of blocks.
  row("shampoo, zero_state<1>, AdaScale", flags<false, true, false>{}, shampoo, z1, one_buffer_reduce{},
      allreduce_mean{});
  row("shampoo, zero_state<2>, scaler", flags<true, false, false>{}, shampoo, z2, one_buffer_reduce{},
      allreduce_mean{});
  row("soap, zero_state<2>, AdaScale", flags<false, true, false>{}, soap, z2, one_buffer_reduce{},
      allreduce_mean{});
  row("muon, zero_state<1> by tensor, scaler", flags<true, false, false>{}, muon, z1_whole,
      one_buffer_reduce{}, allreduce_mean{});
}

}  // namespace train_combinations_scenario
