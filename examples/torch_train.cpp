// A LibTorch model trained data-parallel with gradapt through the torch adapter
// (gradapt/adapters/torch.hpp): a 64-32-10 torch::nn MLP on the 8x8 handwritten digits
// (examples/data/digits.csv), one model replica per rank on in-process ranks (comm::threads).
//
// LibTorch runs the forward and backward passes; gradapt sees the same memory through views
// and never copies it:
//   - every parameter's .grad() is a slice of ONE flat tensor (the gradient bucket, as
//     DistributedDataParallel's gradient_as_bucket_view); autograd accumulates into it in place;
//   - gradapt::param_list_of builds the parameter list (value + gradient views) from
//     named_parameters(); rank 0's initial weights reach the other ranks by comm.broadcast on
//     the value views;
//   - each step: the loss is multiplied by the loss scaler's scale before backward(), the
//     scaler unscales the gradients and agrees on overflow (gradapt::loss_scaler), ONE
//     gradapt::allreduce_with_norms over the bucket sums the gradients and yields the two
//     norms of the data-parallel gradient noise scale (gradapt::gradient_noise_scale), AdaScale
//     turns the noise scale into a learning-rate gain and a scale-invariant progress tau
//     (gradapt::adascale, with sqrt_gain since LAMB is an adaptive method), and gradapt::lamb
//     updates the parameters in place.
// Training runs until tau reaches the base schedule's length, so the larger batch of P ranks
// needs fewer steps when the gradient noise allows. The program prints the held-out accuracy
// and whether all replicas hold bitwise identical parameters.
//
//   torch_train [--data examples/data/digits.csv] [--ranks 2] [--iters T] [--lr LR] [--seed S]
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numbers>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gradapt/adapters/torch.hpp>
#include <gradapt/gradapt.hpp>
#include <gradapt/optim/lamb.hpp>
#include <gradapt/precision/loss_scaler.hpp>
#include <gradapt/scaling/adascale.hpp>
#include <gradapt/stats/allreduce_with_norms.hpp>
#include <gradapt/stats/gradient_noise_scale.hpp>

#include "common/check.hpp"

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

constexpr int features = 64, hidden = 32, classes = 10;
constexpr int local_batch = 32;  // examples per rank and step; the base batch of AdaScale

/// The digits as tensors: x [n, 64] (pixels / 16), y [n] (labels).
struct split {
  at::Tensor x, y;
};

/// Reads the CSV, shuffles it with a fixed seed and splits it 80/20 into train and test.
std::pair<split, split> load(const std::string& path) {
  std::ifstream f(path);
  if (!f) examples::fail("torch_train: cannot open '", path, "' (pass --data PATH)");
  std::vector<float> px;
  std::vector<std::int64_t> labels;
  std::string line;
  while (std::getline(f, line)) {
    std::stringstream ss(line);
    std::string cell;
    std::getline(ss, cell, ',');
    labels.push_back(std::stoll(cell));
    for (int j = 0; j < features; ++j) {
      if (!std::getline(ss, cell, ','))
        examples::fail("torch_train: row ", labels.size(), " of '", path, "' has fewer than 65 fields");
      px.push_back(std::stof(cell) / 16.0f);
    }
  }
  const auto n = static_cast<std::int64_t>(labels.size());
  if (n < 10) examples::fail("torch_train: '", path, "' holds only ", n, " rows");
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(2024));
  const std::int64_t n_train = n * 4 / 5;
  auto make = [&](std::int64_t begin, std::int64_t end) {
    split s{at::empty({end - begin, features}, at::kFloat), at::empty({end - begin}, at::kLong)};
    auto xs = gradapt::view_of<float>(s.x);  // fill the tensors through views
    auto* ys = s.y.data_ptr<std::int64_t>();
    for (std::int64_t i = begin; i < end; ++i) {
      const auto src = static_cast<std::size_t>(order[static_cast<std::size_t>(i)]);
      std::copy_n(px.begin() + static_cast<std::ptrdiff_t>(src * features), features,
                  &xs[static_cast<std::size_t>((i - begin) * features)]);
      ys[i - begin] = labels[src];
    }
    return s;
  };
  return {make(0, n_train), make(n_train, n)};
}

struct mlp_impl : torch::nn::Module {
  mlp_impl()
      : fc1(register_module("fc1", torch::nn::Linear(features, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, classes))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(fc1(x).relu()); }
  torch::nn::Linear fc1, fc2;
};

/// Mean cross-entropy of the logits against the labels.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& y) {
  return -logits.log_softmax(1).gather(1, y.unsqueeze(1)).mean();
}

struct options {
  std::string data = GRADAPT_EXAMPLES_DATA_DIR "/digits.csv";
  int ranks = 2;
  double iters = 600;  // T: base-batch iterations of the schedule
  double lr = 0.01;
  std::uint64_t seed = 1;  // LibTorch's initialisation of rank 0's replica
};

/// What rank 0 reports.
struct report {
  int steps = 0;
  double tau = 0, mean_gain = 0, last_gain = 0, accuracy = 0, first_loss = 0, last_loss = 0;
  std::string b_simple;  ///< the final smoothed noise scale, as text
  std::size_t bucket = 0, tensors = 0, skipped = 0;
  bool in_sync = false;
};

void train(gradapt::comm::threads& comm, mlp_impl& model, const split& train_set, const split& test_set,
           const options& opt, report& out) {
  const int P = comm.size(), rank = comm.rank();

  // The gradient bucket: every .grad() is a slice of one flat tensor.
  std::int64_t total = 0;
  for (const auto& p : model.parameters()) total += p.numel();
  at::Tensor bucket = at::zeros({total}, at::kFloat);
  std::int64_t offset = 0;
  for (auto& p : model.parameters()) {
    p.mutable_grad() = bucket.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
  }
  const auto params = gradapt::param_list_of<float>(
      model, {.flags = [](const std::string&, const at::Tensor& v) {
        return gradapt::param_flags{.skip_weight_decay = v.dim() == 1, .skip_trust_ratio = v.dim() == 1};
      }});
  const auto bucket_view = gradapt::view_of<float>(bucket);
  if (params.grads().front().data() != bucket_view.data())
    examples::fail("torch_train: the gradient views do not start at the bucket");

  // Rank 0's initial weights everywhere (the views are the parameters' own memory).
  for (const auto& v : params.values()) comm.broadcast(v, 0);

  const gradapt::host backend{.threads = 1};
  const gradapt::lamb opt_lamb({.lr = opt.lr, .weight_decay = 1e-4});
  auto state = opt_lamb.init(backend, params);
  gradapt::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = 100});
  gradapt::gradient_noise_scale gns({.smoothing = 0.95});
  gradapt::adascale ada({.scale = static_cast<double>(P), .sqrt_gain = true});
  // Base schedule (a function of base-batch iterations tau): linear warm-up, cosine decay.
  const double T = opt.iters;
  auto schedule = [&](double tau) {
    const double warm = 0.05 * T;
    if (tau < warm) return opt.lr * (tau + 1.0) / warm;
    return opt.lr *
           (0.05 +
            0.95 * 0.5 * (1.0 + std::cos(std::numbers::pi * std::min(1.0, (tau - warm) / (T - warm)))));
  };

  const std::int64_t n = train_set.x.size(0), global = static_cast<std::int64_t>(P) * local_batch;
  std::mt19937 rng(7);  // the same stream on every rank: the ranks split one global batch
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::int64_t cursor = n;  // reshuffle before the first step
  at::Tensor index = at::empty({local_batch}, at::kLong);
  double gain_sum = 0;
  int steps = 0;
  double first_loss = -1, last_loss = 0;
  while (ada.progress() < T) {
    if (cursor + global > n) {
      std::shuffle(order.begin(), order.end(), rng);
      cursor = 0;
    }
    std::copy_n(order.begin() + cursor + rank * local_batch, local_batch, index.data_ptr<std::int64_t>());
    cursor += global;

    bucket.zero_();  // in place: the views stay valid
    const at::Tensor loss =
        cross_entropy(model.forward(train_set.x.index_select(0, index)), train_set.y.index_select(0, index));
    loss.mul(scaler.scale()).backward();

    // Unscale (and agree on overflow across ranks) before the gradients are combined.
    if (!scaler.unscale(backend, comm, params)) continue;
    // Sum over ranks + the noise-scale norms in the same pass; then the mean.
    const auto norms = gradapt::allreduce_with_norms(comm, backend, bucket_view);
    backend.apply([inv = 1.0f / static_cast<float>(P)](float& g) { g *= inv; }, bucket_view);
    if (P > 1) gns.update(norms, P, {.micro_batch = local_batch});
    const auto s = ada.step(schedule, gns, local_batch);
    opt_lamb.step(backend, params, state, {.lr = s.lr});
    gain_sum += s.gain;
    ++steps;

    double l = loss.item<double>();  // the mean loss over all ranks, for the report
    comm.allreduce(gradapt::tensor_view<double, gradapt::host_space>::scalar(&l), gradapt::reduce_op::sum);
    l /= P;
    if (first_loss < 0) first_loss = last_loss = l;
    last_loss = 0.9 * last_loss + 0.1 * l;  // smoothed over about 10 steps
  }

  // Are the replicas identical? Compare every parameter bit for bit with rank 0's.
  std::vector<float> mine, ref;
  for (const auto& v : params.values()) mine.insert(mine.end(), v.data(), v.data() + v.size());
  ref = mine;
  comm.broadcast(gradapt::host_view(ref), 0);
  double differ = std::memcmp(mine.data(), ref.data(), mine.size() * sizeof(float)) != 0 ? 1.0 : 0.0;
  comm.allreduce(gradapt::tensor_view<double, gradapt::host_space>::scalar(&differ), gradapt::reduce_op::sum);

  if (rank == 0) {
    at::NoGradGuard no_grad;
    const at::Tensor pred = model.forward(test_set.x).argmax(1);
    out.accuracy = pred.eq(test_set.y).to(at::kDouble).mean().item<double>();
    out.steps = steps;
    out.tau = ada.progress();
    out.mean_gain = steps ? gain_sum / steps : 0.0;
    const auto b = gns.b_simple();
    out.b_simple = b ? std::to_string(static_cast<long long>(std::lround(*b)))
                     : std::string("undefined (smoothed |G|^2 <= 0 near the optimum)");
    out.last_gain = ada.last_gain();
    out.first_loss = first_loss;
    out.last_loss = last_loss;
    out.bucket = static_cast<std::size_t>(total);
    out.tensors = params.size();
    out.skipped = scaler.skipped();
    out.in_sync = differ == 0.0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--data" && has_value)
      opt.data = argv[++i];
    else if (a == "--ranks" && has_value)
      opt.ranks = std::stoi(argv[++i]);
    else if (a == "--iters" && has_value)
      opt.iters = std::stod(argv[++i]);
    else if (a == "--lr" && has_value)
      opt.lr = std::stod(argv[++i]);
    else if (a == "--seed" && has_value)
      opt.seed = std::stoull(argv[++i]);
    else {
      std::fprintf(stderr, "usage: torch_train [--data PATH] [--ranks P] [--iters T] [--lr LR] [--seed S]\n");
      return 2;
    }
  }
  try {
    if (opt.ranks < 2) examples::fail("torch_train: --ranks is ", opt.ranks, " (expected >= 2)");
    at::set_num_threads(1);  // one LibTorch thread per rank
    const auto [train_set, test_set] = load(opt.data);
    // One replica per rank, built here in order: LibTorch's global generator is shared by all
    // threads, so building them on the rank threads would make the run non-deterministic.
    at::manual_seed(opt.seed);
    std::vector<std::shared_ptr<mlp_impl>> replicas;
    for (int i = 0; i < opt.ranks; ++i) replicas.push_back(std::make_shared<mlp_impl>());
    report r;
    gradapt::comm::run_threads(opt.ranks, [&](gradapt::comm::threads& comm) {
      train(comm, *replicas[static_cast<std::size_t>(comm.rank())], train_set, test_set, opt, r);
    });
    std::printf(
        "torch_train: %d ranks x %d examples, gradient bucket of %zu floats over %zu tensors (zero-copy)\n",
        opt.ranks, local_batch, r.bucket, r.tensors);
    std::printf(
        "torch_train: %d LAMB steps reached tau = %.1f of %.0f base iterations (AdaScale gain: mean %.3f, "
        "last %.3f; %zu overflow skips)\n",
        r.steps, r.tau, opt.iters, r.mean_gain, r.last_gain, r.skipped);
    std::printf("torch_train: final noise scale B_simple %s\n", r.b_simple.c_str());
    std::printf("torch_train: loss %.4f -> %.4f, held-out accuracy %.4f, ranks in sync: %s\n", r.first_loss,
                r.last_loss, r.accuracy, r.in_sync ? "yes" : "no");
    return r.in_sync ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
