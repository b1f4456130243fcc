#pragma once
// The data-parallel training harness shared by the optimizer comparisons on the digits MLP
// (shampoo_digits, kfac_digits): a train/held-out split, the evaluation points, the evaluator
// that checks the replicas, the per-rank batch stream and the gradient allreduce-mean.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include <gradapt/gradapt.hpp>

#include "digits_mlp.hpp"

namespace examples::digits {

/// Training and held-out example indices.
struct split {
  std::vector<int> train, test;
};

/// One evaluation: the step, the training seconds so far, the training loss and the held-out
/// accuracy.
struct point {
  long step;
  double seconds, loss, accuracy;
};

/// What the evaluator records of one run.
struct run_trace {
  std::vector<point> points;
  bool identical = false;  ///< all replicas bitwise equal at the last evaluation
};

/// Evaluation on every rank's own slice of the data, outside the timed steps: rank r sums the
/// losses of training examples r, r + N, ... and counts its correct held-out predictions; rank
/// 0 adds the slices in rank order (the same bits on every run) and compares the replicas.
class evaluator {
 public:
  evaluator(const dataset& d, const split& s, int ranks, run_trace& out)
      : d_(d), s_(s), slots_(static_cast<std::size_t>(ranks)), out_(out) {}

  /// Collective over `comm` (two barriers).
  void record(gradapt::comm::threads& comm, mlp& m, long step, double seconds) {
    const auto n = static_cast<std::size_t>(comm.size());
    const auto r = static_cast<std::size_t>(comm.rank());
    auto& mine = slots_[r];
    mine.loss_sum = 0;
    mine.correct = 0;
    std::vector<int> idx;
    for (std::size_t i = r; i < s_.train.size(); i += n) idx.push_back(s_.train[i]);
    if (!idx.empty())
      mine.loss_sum =
          m.loss(d_, idx.data(), static_cast<int>(idx.size()), false) * static_cast<double>(idx.size());
    for (std::size_t i = r; i < s_.test.size(); i += n)
      if (m.predict(d_, s_.test[i]) == d_.y[static_cast<std::size_t>(s_.test[i])]) ++mine.correct;
    mine.params.resize(mlp::n_params);
    auto it = std::copy(m.w1.begin(), m.w1.end(), mine.params.begin());
    it = std::copy(m.b1.begin(), m.b1.end(), it);
    it = std::copy(m.w2.begin(), m.w2.end(), it);
    std::copy(m.b2.begin(), m.b2.end(), it);
    comm.barrier();
    if (comm.rank() == 0) {
      double loss = 0;
      long correct = 0;
      out_.identical = true;
      for (const auto& s : slots_) {
        loss += s.loss_sum;
        correct += s.correct;
        if (std::memcmp(s.params.data(), slots_[0].params.data(), mlp::n_params * sizeof(float)) != 0)
          out_.identical = false;
      }
      loss /= static_cast<double>(s_.train.size());
      out_.points.push_back(
          {step, seconds, loss, static_cast<double>(correct) / static_cast<double>(s_.test.size())});
    }
    comm.barrier();
  }

 private:
  struct slot {
    double loss_sum = 0;
    long correct = 0;
    std::vector<float> params;
  };
  const dataset& d_;
  const split& s_;
  std::vector<slot> slots_;
  run_trace& out_;
};

/// Fills idx with this rank's training examples of step t: the same stream for every run.
inline void batch_of(int batch, int ranks, const split& s, long t, int rank, std::vector<int>& idx) {
  const auto n = static_cast<long>(s.train.size());
  for (int k = 0; k < batch; ++k)
    idx[static_cast<std::size_t>(k)] =
        s.train[static_cast<std::size_t>(((t * ranks + rank) * batch + k) % n)];
}

/// The gradient allreduce of data parallelism: sum over the flat gradient bucket, then / N.
inline void allreduce_mean(gradapt::comm::threads& comm, const gradapt::host& backend, mlp& model) {
  comm.allreduce(model.grad_bucket(), gradapt::reduce_op::sum);
  const float inv = 1.0f / static_cast<float>(comm.size());
  backend.apply_list([inv](float& g) { g *= inv; }, model.params.grads());
}

}  // namespace examples::digits
