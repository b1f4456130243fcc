// Data-parallel least squares with Eigen matrices and gradapt, through the Eigen adapter
// (gradapt/adapters/eigen.hpp): 3 in-process ranks (comm::threads), each holding its own rows
// of the data as Eigen matrices, fit a d x k weight matrix W to Y = X W* + noise.
//
// Eigen computes each rank's gradient G_r = X_rᵀ (X_r W − Y_r) / n into an Eigen matrix it
// owns; gradapt sees W and G through zero-copy views: the gradients are averaged by an
// allreduce on the view of G, and gradapt::sgd (momentum 0.9) updates W in place. W is
// column-major (Eigen's default), so its view is the row-major [k, d] view of the same
// memory: element-wise work does not care, which is all an optimizer and an allreduce do.
//
// The result is checked against an independent reference: the least-squares solution of the
// whole data set, solved directly by Eigen's Householder QR.
//
//   eigen_regression [--ranks 3] [--steps 300]
#include <Eigen/Dense>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gradapt/adapters/eigen.hpp>
#include <gradapt/gradapt.hpp>
#include <gradapt/optim/sgd.hpp>

#include "common/check.hpp"

namespace {

constexpr int d = 8, k = 3, rows_per_rank = 200;

/// The whole data set, generated once; rank r owns rows [r n, (r + 1) n).
struct problem {
  Eigen::MatrixXd x, y;
};

problem make_problem(int ranks) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd;
  const int n = ranks * rows_per_rank;
  problem p{Eigen::MatrixXd(n, d), Eigen::MatrixXd(n, k)};
  Eigen::MatrixXd w_true(d, k);
  for (Eigen::Index i = 0; i < w_true.size(); ++i) w_true.data()[i] = nd(rng);
  for (Eigen::Index i = 0; i < p.x.size(); ++i) p.x.data()[i] = nd(rng);
  p.y = p.x * w_true;
  for (Eigen::Index i = 0; i < p.y.size(); ++i) p.y.data()[i] += 0.1 * nd(rng);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 3, steps = 300;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ranks" && i + 1 < argc)
      ranks = std::stoi(argv[++i]);
    else if (a == "--steps" && i + 1 < argc)
      steps = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: eigen_regression [--ranks P] [--steps N]\n");
      return 2;
    }
  }
  try {
    if (ranks < 1 || steps < 1) examples::fail("eigen_regression: --ranks and --steps must be >= 1");
    const problem data = make_problem(ranks);
    // Independent reference: the least-squares solution of all rows, solved directly.
    const Eigen::MatrixXd w_ls = data.x.colPivHouseholderQr().solve(data.y);

    std::vector<Eigen::MatrixXd> result(static_cast<std::size_t>(ranks));
    gradapt::comm::run_threads(ranks, [&](gradapt::comm::threads& comm) {
      const int r = comm.rank();
      // This rank's rows (copied once into matrices it owns), its weights and gradient.
      const Eigen::MatrixXd x = data.x.middleRows(r * rows_per_rank, rows_per_rank);
      const Eigen::MatrixXd y = data.y.middleRows(r * rows_per_rank, rows_per_rank);
      Eigen::MatrixXd w = Eigen::MatrixXd::Zero(d, k);
      Eigen::MatrixXd g(d, k);
      Eigen::MatrixXd residual(rows_per_rank, k);

      gradapt::param_list<double> params;
      params.add("W", gradapt::view_of(w), gradapt::view_of(g));  // both [k, d]: column-major d x k
      const gradapt::host backend{.threads = 1};
      const gradapt::sgd opt({.lr = 0.1, .momentum = 0.9});
      auto state = opt.init(backend, params);
      const double inv_ranks = 1.0 / comm.size();
      for (int s = 0; s < steps; ++s) {
        residual.noalias() = x * w - y;
        g.noalias() = x.transpose() * residual / static_cast<double>(rows_per_rank);
        comm.allreduce(gradapt::view_of(g), gradapt::reduce_op::sum);  // in place, on Eigen's memory
        backend.apply([inv_ranks](double& v) { v *= inv_ranks; }, gradapt::view_of(g));
        opt.step(backend, params, state);
      }
      result[static_cast<std::size_t>(r)] = w;
    });

    bool in_sync = true;
    for (const auto& w : result)
      in_sync = in_sync && std::memcmp(w.data(), result[0].data(), sizeof(double) * d * k) == 0;
    const double rel = (result[0] - w_ls).norm() / w_ls.norm();
    const bool converged = rel < 1e-6;
    std::printf(
        "eigen_regression: %d ranks x %d rows, W %d x %d (column-major, viewed as [%d, %d]), %d SGD steps\n",
        ranks, rows_per_rank, d, k, k, d, steps);
    std::printf(
        "eigen_regression: relative distance to the direct least-squares solution %.3g (< 1e-6: %s), "
        "ranks in sync: %s\n",
        rel, converged ? "converged" : "NOT converged", in_sync ? "yes" : "no");
    return converged && in_sync ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
