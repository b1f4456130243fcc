// gradapt's demo (README command 1): data-parallel training of a 64-32-10 ReLU MLP on the 8x8
// handwritten digits (examples/data/digits.csv, 1797 images: 1497 to train, 300 held out) with
// the composed step gradapt::train::data_parallel_step:
//
//   fp16 gradients through dynamic loss scaling (gradapt::loss_scaler) -> gradient allreduce
//   with the noise-scale norms -> gradient noise scale + AdaScale gain (sqrt gain: LAMB is an
//   adaptive method) -> LAMB at lr x gain
//
// Each rank computes its gradient in fp32 with the loss multiplied by the loss scale and stores
// it in fp16, as mixed-precision training does; a gradient above 65504 becomes inf, the step is
// skipped on every rank and the scale backs off (visible in the "loss scale" column and the
// skipped count). A hook sets the learning rate from AdaScale's scale-invariant progress and
// counts the overflows.
//
// One progress line per epoch; writes demo.csv and demo.svg into --out. The ranks are N
// in-process threads (comm::threads, default 4), or MPI processes when launched by mpirun
// (--mpi, or detected from OMPI_COMM_WORLD_SIZE / PMI_SIZE) in a build with MPI.
//
//   demo [--ranks N] [--epochs E] [--batch B] [--lr LR] [--dtype fp16|bf16] [--out DIR]
//        [--data PATH] [--mpi]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gradapt/gradapt.hpp>
#include <gradapt/optim/lamb.hpp>
#include <gradapt/train/data_parallel_step.hpp>

#include "common/check.hpp"
#include "common/digits_mlp.hpp"
#include "common/svg_plot.hpp"

#ifdef GRADAPT_DEMO_WITH_MPI
#include <mpi.h>

#include <gradapt/comm/mpi.hpp>
#endif

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

using examples::digits::dataset;
using examples::digits::mlp;

struct options {
  int ranks = 4;
  int epochs = 30;
  int batch = 16;  ///< examples per rank per step (= AdaScale's base batch: S = ranks)
  double lr = 0.01;
  bool bf16 = false;
  bool mpi = false;
  std::string out = ".";
  std::string data = GRADAPT_EXAMPLES_DATA_DIR "/digits.csv";
};

/// One line of the progress table (rank 0's view; every metric is the same on every rank).
struct epoch_row {
  int epoch = 0;
  double loss = 0, accuracy = 0, noise_scale = 0, gain = 0, lr = 0, loss_scale = 0, progress = 0;
  std::uint64_t skipped = 0;
  bool in_sync = true;
};

/// The learning rate as a function of AdaScale's progress τ (base-batch iterations): a short
/// warm-up, then inverse-square-root decay; and the overflow counter. Runs on every rank.
struct schedule_hook {
  double lr0;
  double warmup;
  std::uint64_t overflows = 0;
  double lr(double tau) const {
    const double t = tau + 1.0;
    return t < warmup ? lr0 * t / warmup : lr0 * std::sqrt(warmup / t);
  }
  void before_step(gradapt::train::step_settings& s, const gradapt::train::step_metrics& last) {
    s.lr = lr(last.progress);
  }
  void on_overflow(gradapt::train::step_settings&, const gradapt::train::step_metrics&) { ++overflows; }
};

/// The training loop of one rank, over any host communicator.
template <class G, class Comm>
std::vector<epoch_row> train(Comm& comm, const dataset& d, const std::vector<int>& train_idx,
                             const std::vector<int>& test_idx, const options& o, bool print) {
  const int r = comm.rank(), n = comm.size();
  gradapt::host backend{.threads = 1};
  mlp model;
  // fp16 (or bf16) gradients in one flat bucket, viewed per parameter next to fp32 weights.
  std::vector<G> g16(mlp::n_params);
  gradapt::param_list<float, G> params;
  {
    std::size_t off = 0;
    for (const auto& e : model.params.entries()) {
      const auto g = gradapt::tensor_view<G, gradapt::host_space>(g16.data() + off, e.value.shape());
      params.add(e.name, e.value, g, e.flags);
      off += e.value.size();
    }
  }
  schedule_hook hook{o.lr, 20.0};
  auto step = gradapt::train::make_data_parallel_step(
      comm, backend, params, gradapt::lamb({.lr = o.lr, .weight_decay = 1e-4}),
      {.lr = o.lr, .local_batch = static_cast<double>(o.batch)},
      gradapt::loss_scaler({.init_scale = 65536.0, .growth_interval = 100}),
      gradapt::train::adascale_policy{
          .base_batch = static_cast<double>(o.batch), .noise = {.smoothing = 0.95}, .sqrt_gain = true},
      std::ref(hook));

  const int per_step = n * o.batch;
  const int steps = static_cast<int>(train_idx.size()) / per_step;
  std::vector<int> order = train_idx, idx(static_cast<std::size_t>(o.batch));
  std::vector<epoch_row> rows;
  for (int epoch = 1; epoch <= o.epochs; ++epoch) {
    std::shuffle(order.begin(), order.end(),
                 std::mt19937(1000u + static_cast<unsigned>(epoch)));  // same on all ranks
    double loss_sum = 0;
    for (int s = 0; s < steps; ++s) {
      for (int k = 0; k < o.batch; ++k)
        idx[static_cast<std::size_t>(k)] = order[static_cast<std::size_t>((s * n + r) * o.batch + k)];
      const double loss = model.loss(d, idx.data(), o.batch, true);  // fp32 mean gradient
      const double scale = step.loss_scale();                        // the loss is scaled ...
      for (std::size_t i = 0; i < g16.size(); ++i)                   // ... and stored in 16 bits
        g16[i] = G(static_cast<float>(static_cast<double>(model.grad[i]) * scale));
      step.step({.loss = loss});
      loss_sum += loss;
    }
    // Held-out accuracy and the ranks' agreement (the parameters are identical on every rank).
    double stats[3] = {loss_sum, 0.0, 0.0};
    for (std::size_t k = static_cast<std::size_t>(r); k < test_idx.size(); k += static_cast<std::size_t>(n))
      stats[1] += model.predict(d, test_idx[k]) == d.y[static_cast<std::size_t>(test_idx[k])] ? 1.0 : 0.0;
    std::vector<float> w0 = model.w1;
    comm.broadcast(gradapt::host_view(w0), 0);
    stats[2] = std::memcmp(w0.data(), model.w1.data(), w0.size() * sizeof(float)) == 0 ? 0.0 : 1.0;
    comm.allreduce(gradapt::tensor_view<double, gradapt::host_space>::vector(stats, 3),
                   gradapt::reduce_op::sum);
    const auto& m = step.metrics();
    epoch_row row{epoch,
                  stats[0] / (static_cast<double>(steps) * n),
                  stats[1] / static_cast<double>(test_idx.size()),
                  m.noise_scale,
                  m.gain,
                  m.lr,
                  step.loss_scale(),
                  m.progress,
                  step.scaler().skipped(),
                  stats[2] == 0.0};
    rows.push_back(row);
    if (print)
      std::printf(
          "epoch %3d  loss %.4f  accuracy %.3f  noise scale %8.1f  gain %.2f  lr %.5f  loss scale %6.0f"
          "  (skipped %llu)\n",
          row.epoch, row.loss, row.accuracy, row.noise_scale, row.gain, row.lr, row.loss_scale,
          static_cast<unsigned long long>(row.skipped));
    if (!row.in_sync) examples::fail("demo: the ranks disagree on the weights after epoch ", epoch);
  }
  return rows;
}

void write_outputs(const std::vector<epoch_row>& rows, const options& o, int ranks) {
  const std::string csv_path = o.out + "/demo.csv", svg_path = o.out + "/demo.svg";
  std::ofstream csv(csv_path);
  csv << "epoch,loss,accuracy,noise_scale,gain,lr,loss_scale,skipped,progress\n";
  for (const auto& r : rows)
    csv << r.epoch << ',' << r.loss << ',' << r.accuracy << ',' << r.noise_scale << ',' << r.gain << ','
        << r.lr << ',' << r.loss_scale << ',' << r.skipped << ',' << r.progress << '\n';
  examples::series loss{"train loss", {}}, err{"held-out error", {}}, gain{"gain / S", {}};
  for (const auto& r : rows) {
    loss.points.emplace_back(r.epoch, r.loss);
    err.points.emplace_back(r.epoch, std::max(1.0 - r.accuracy, 1e-3));
    gain.points.emplace_back(r.epoch, r.gain / ranks);
  }
  examples::write_svg(svg_path, {loss, err, gain},
                      {.title = "gradapt demo: digits MLP, " + std::to_string(ranks) +
                                " ranks, LAMB + AdaScale + noise scale + fp16 loss scaling",
                       .x_label = "epoch",
                       .y_label = "value (log scale)",
                       .log_y = true});
  std::printf("wrote %s and %s\n", csv_path.c_str(), svg_path.c_str());
}

/// The value after the last occurrence of `name` (so a later flag overrides an earlier one).
std::string arg(int argc, char** argv, const char* name, const std::string& def) {
  std::string v = def;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) v = argv[i + 1];
  return v;
}
bool flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return true;
  return false;
}

template <class G, class Comm>
int run(Comm& comm, const options& o) {
  const dataset d = examples::digits::load(o.data, "demo");
  std::vector<int> all(static_cast<std::size_t>(d.n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(7));
  const std::size_t held_out = 300;
  const std::vector<int> test_idx(all.end() - static_cast<std::ptrdiff_t>(held_out), all.end());
  const std::vector<int> train_idx(all.begin(), all.end() - static_cast<std::ptrdiff_t>(held_out));
  const bool print = comm.rank() == 0;
  if (print)
    std::printf(
        "gradapt demo: 64-32-10 MLP on %zu digits (%zu held out), %d ranks x batch %d, %s gradients, "
        "LAMB + AdaScale + noise scale + dynamic loss scaling\n",
        train_idx.size(), held_out, comm.size(), o.batch, o.bf16 ? "bf16" : "fp16");
  const auto t0 = std::chrono::steady_clock::now();
  const auto rows = train<G>(comm, d, train_idx, test_idx, o, print);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (print) {
    const auto& last = rows.back();
    std::printf("final: held-out accuracy %.3f, loss %.4f, overflow skips %llu, ranks in sync: yes, %.1f s\n",
                last.accuracy, last.loss, static_cast<unsigned long long>(last.skipped), secs);
    write_outputs(rows, o, comm.size());
  }
  return 0;
}

template <class Comm>
int run_dtype(Comm& comm, const options& o) {
  return o.bf16 ? run<gradapt::bfloat16>(comm, o) : run<gradapt::half>(comm, o);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    o.ranks = std::stoi(arg(argc, argv, "--ranks", "4"));
    o.epochs = std::stoi(arg(argc, argv, "--epochs", "30"));
    o.batch = std::stoi(arg(argc, argv, "--batch", "16"));
    o.lr = std::stod(arg(argc, argv, "--lr", "0.01"));
    const std::string dtype = arg(argc, argv, "--dtype", "fp16");
    o.out = arg(argc, argv, "--out", ".");
    o.data = arg(argc, argv, "--data", o.data);
    o.mpi = flag(argc, argv, "--mpi") || std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE");
    if (dtype != "fp16" && dtype != "bf16")
      examples::fail("demo: --dtype is '", dtype, "' (expected fp16 or bf16)");
    o.bf16 = dtype == "bf16";
    if (o.ranks < 1 || o.epochs < 1 || o.batch < 1 || !(o.lr > 0))
      examples::fail("demo: expected --ranks N >= 1, --epochs E >= 1, --batch B >= 1, --lr > 0");
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "%s\nusage: demo [--ranks N] [--epochs E] [--batch B] [--lr LR] [--dtype fp16|bf16] "
                 "[--out DIR] [--data PATH] [--mpi]\n",
                 e.what());
    return 2;
  }
  try {
    if (o.mpi) {
#ifdef GRADAPT_DEMO_WITH_MPI
      int provided = 0;
      MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
      int rc = 0;
      try {
        gradapt::comm::mpi comm;
        rc = run_dtype(comm, o);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      MPI_Finalize();
      return rc;
#else
      examples::fail(
          "demo: MPI was requested (--mpi or an mpirun environment) but this build has no MPI; "
          "configure gradapt with an MPI library found (GRADAPT_WITH_MPI=ON)");
#endif
    }
    gradapt::comm::run_threads(o.ranks, [&](gradapt::comm::threads& comm) { run_dtype(comm, o); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
