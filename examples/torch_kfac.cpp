// K-FAC on a LibTorch model: a 64-32-10 torch::nn MLP on the 8x8 handwritten digits
// (examples/data/digits.csv), data-parallel on in-process ranks (comm::threads, 2 by default),
// with gradapt::kfac preconditioning both Linear layers before an SGD-with-momentum step,
// against the same SGD alone: steps to a fixed held-out accuracy.
//
// gradapt has no module hooks; the model hands K-FAC what it needs through zero-copy views
// (gradapt/adapters/torch.hpp):
//   - a, a Linear's input: the model's forward keeps each Linear's input tensor, detached
//     (fc1: the pixels, rows x 64; fc2: the hidden ReLU activations, rows x 32);
//   - g, a Linear's output gradient: the forward registers a hook on each Linear's output
//     tensor with Tensor::register_hook; autograd calls it during backward() with dL/dy
//     (rows x 32 and rows x 10), and the hook keeps that tensor.
//   The forward does both only on steps where kf.factor_update_due(state) is true, and the
//   kept tensors go to kf.accumulate as tensor_view<const float, host_space> (contiguous).
//   - the gradients: every parameter's .grad() is a slice of one flat bucket (as in
//     torch_train), summed over the ranks with one allreduce and divided by their number;
//     kf.step(comm, state, grads, lr) then rewrites each Linear's weight.grad() (out x in,
//     LibTorch's layout) and bias.grad() in place through kfac_grad<float> views, and
//     gradapt::sgd (momentum 0.9) steps on the rewritten gradients.
//
// The scale of g. The loss is the batch mean of the cross-entropy, so row i of g is
// (1/rows) times the gradient of example i's own loss. K-FAC's G is the empirical Fisher's
// output factor, built from the per-example gradients (kfac-pytorch multiplies its g by the
// batch size; examples/kfac_digits.cpp computes the per-example gradients directly): the 1/rows
// of the mean would scale G by 1/rows^2 against the damping. gradapt::kfac::accumulate divides
// g by its loss_scale argument, so the example passes loss_scale = 1/rows: G is then built
// from rows * g, the per-example gradients, without copying g. (With a loss scaler in the
// loop, pass scaler.scale() / rows.)
//
// The comparison follows examples/kfac_digits.cpp on 2 ranks: the same train/held-out split
// (300 held out, data order seed 7), the same stream of examples (at step t rank r takes
// training examples (2t + r) * 16 .. (2t + r) * 16 + 15 of the fixed shuffle), the same schedule
// (linear warm-up over 20 steps to the peak rate, cosine decay to 0 at step 600), weight decay
// 1e-4 on the weight matrices and the same K-FAC options (eigen, factors every step with decay
// 0.95, decompositions every 10 steps, damping 0.003, kl_clip 0.001). The initial weights are
// LibTorch's own (torch::nn::Linear's initialisation, seed --init-seed), built once per run and
// broadcast from rank 0.
//
// Learning rates: each run's peak rate is the one that reaches the target accuracy in the
// fewest steps (ties: the higher final accuracy) on the grid 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3,
// 1, 3 (`torch_kfac --grid 1` runs it and prints the table; docs/algorithms/kfac.md, "From
// LibTorch", shows the measured one). Chosen: SGD 0.1, K-FAC + SGD 3. KL clipping caps
// lr^2 <V, M> at kl_clip, so from 0.3 up K-FAC's step stops growing with the rate and those
// rates tie on steps.
//
// Rank 0 evaluates the held-out accuracy every --eval-every steps (default 5) and after the
// last one. The program prints each run's first evaluated step at the target accuracy
// (--target, default 0.95), its final training loss and accuracy, whether the replicas hold
// bitwise identical parameters at the end, and ends with
//   "torch_kfac: K-FAC + SGD reaches held-out accuracy <A> at step <s>, SGD at step <S>
//    (<r>x fewer steps), replicas bitwise identical: yes: PASS"
// PASS needs both runs to reach A, s < S and identical replicas in both runs; otherwise the
// line ends in FAIL and the exit status is 1.
//
//   torch_kfac [--data examples/data/digits.csv] [--ranks 2] [--steps 600] [--batch 16]
//              [--warmup 20] [--weight-decay 1e-4] [--target 0.95] [--lr-sgd 0.1]
//              [--lr-kfac 3] [--damping 0.003] [--inv-update-steps 10] [--kl-clip 0.001]
//              [--eval-every 5] [--seed 7] [--init-seed 1] [--grid 0]
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gradapt/adapters/torch.hpp>
#include <gradapt/gradapt.hpp>
#include <gradapt/linalg/host_lapack.hpp>
#include <gradapt/optim/kfac.hpp>
#include <gradapt/optim/sgd.hpp>

#include "common/check.hpp"
#include "common/cli.hpp"
#include "common/digits_mlp.hpp"
#include "common/digits_run.hpp"

#ifndef GRADAPT_EXAMPLES_DATA_DIR
#define GRADAPT_EXAMPLES_DATA_DIR "examples/data"
#endif

namespace {

namespace dg = examples::digits;

/// The MLP. forward(x, true) also keeps what K-FAC needs of this pass: each Linear's input a
/// (detached) and, through a hook on its output, the output gradient g of the next backward().
struct mlp_impl : torch::nn::Module {
  mlp_impl()
      : fc1(register_module("fc1", torch::nn::Linear(dg::features, dg::hidden))),
        fc2(register_module("fc2", torch::nn::Linear(dg::hidden, dg::classes))) {}

  at::Tensor forward(const at::Tensor& x, bool keep_kfac_inputs = false) {
    at::Tensor z1 = fc1(x);
    const at::Tensor h = z1.relu();
    at::Tensor z2 = fc2(h);
    if (keep_kfac_inputs) {
      keep(0, x, z1);
      keep(1, h, z2);
    }
    return z2;
  }

  /// Layer i's input a (rows x in) and output gradient g (rows x out) of the last forward with
  /// keep_kfac_inputs, once backward() has run.
  std::array<at::Tensor, 2> a, g;

  torch::nn::Linear fc1, fc2;

 private:
  void keep(std::size_t i, const at::Tensor& input, at::Tensor& output) {
    a[i] = input.detach().contiguous();
    g[i] = at::Tensor();
    // Runs during backward() with dL/d(output); the hook goes away with the output tensor.
    output.register_hook([this, i](at::Tensor grad) { g[i] = grad.detach().contiguous(); });
  }
};

/// Mean cross-entropy of the logits against the labels.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& y) {
  return -logits.log_softmax(1).gather(1, y.unsqueeze(1)).mean();
}

struct config {
  int ranks = 2;
  int batch = 16;
  long steps = 600;
  long warmup = 20;
  double weight_decay = 1e-4;
  double target = 0.95;
  double lr_sgd = 0.1, lr_kfac = 3.0;
  double damping = 0.003, kl_clip = 0.001;
  std::uint64_t inv_update_steps = 10;
  long eval_every = 5;
  unsigned seed = 7;            ///< data order
  std::uint64_t init_seed = 1;  ///< LibTorch's initial weights

  /// The learning rate of step t for peak rate `peak`: linear warm-up over `warmup` steps,
  /// then a cosine decay to 0 at step `steps`.
  double lr_at(long t, double peak) const {
    if (t < warmup) return peak * static_cast<double>(t + 1) / static_cast<double>(warmup);
    const double x = static_cast<double>(t - warmup) / static_cast<double>(std::max(1L, steps - warmup));
    return peak * 0.5 * (1.0 + std::cos(std::numbers::pi * x));
  }

  gradapt::kfac_options kfac() const {
    return {.factor_decay = 0.95,
            .factor_update_steps = 1,
            .inv_update_steps = inv_update_steps,
            .damping = damping,
            .method = gradapt::kfac_method::eigen,
            .kl_clip = kl_clip};
  }
};

/// The digits as tensors: x [n, 64] (pixels / 16), y [n] (labels).
struct tensors {
  at::Tensor x, y;
};

tensors to_tensors(const dg::dataset& d) {
  tensors t{at::empty({d.n, dg::features}, at::kFloat), at::empty({d.n}, at::kLong)};
  const auto x = gradapt::view_of<float>(t.x);  // filled through a view
  std::copy(d.x.begin(), d.x.end(), x.data());
  std::copy(d.y.begin(), d.y.end(), t.y.data_ptr<std::int64_t>());
  return t;
}

at::Tensor index_tensor(const std::vector<int>& idx) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(idx.size())}, at::kLong);
  std::copy(idx.begin(), idx.end(), t.data_ptr<std::int64_t>());
  return t;
}

struct run_result {
  const char* name = "";
  double lr = 0;
  std::optional<long> step_at_target;  ///< first evaluated step at the target accuracy
  double final_accuracy = 0, final_loss = 0;
  double seconds = 0;  ///< the whole run, evaluations included
  bool identical = false;
  std::uint64_t decompositions = 0;  ///< K-FAC: layer decompositions, summed over the ranks
};

/// One run, SGD alone or K-FAC + SGD at peak rate `lr`, on c.ranks in-process ranks.
run_result train(const tensors& data, const dg::split& s, const config& c, bool use_kfac, double lr) {
  run_result out;
  out.name = use_kfac ? "K-FAC + SGD" : "SGD";
  out.lr = lr;
  const at::Tensor test_x = data.x.index_select(0, index_tensor(s.test));
  const at::Tensor test_y = data.y.index_select(0, index_tensor(s.test));
  const at::Tensor train_x = data.x.index_select(0, index_tensor(s.train));
  const at::Tensor train_y = data.y.index_select(0, index_tensor(s.train));

  // One replica per rank, built here in order (LibTorch's generator is global).
  at::manual_seed(c.init_seed);
  std::vector<std::shared_ptr<mlp_impl>> replicas;
  for (int i = 0; i < c.ranks; ++i) replicas.push_back(std::make_shared<mlp_impl>());
  std::vector<std::uint64_t> decompositions(static_cast<std::size_t>(c.ranks), 0);

  const auto t0 = std::chrono::steady_clock::now();
  gradapt::comm::run_threads(c.ranks, [&](gradapt::comm::threads& comm) {
    const int P = comm.size(), rank = comm.rank();
    mlp_impl& model = *replicas[static_cast<std::size_t>(rank)];

    // The gradient bucket: every .grad() is a slice of one flat tensor.
    std::int64_t total = 0;
    for (const auto& p : model.parameters()) total += p.numel();
    at::Tensor bucket = at::zeros({total}, at::kFloat);
    std::int64_t offset = 0;
    for (auto& p : model.parameters()) {
      p.mutable_grad() = bucket.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
    }
    const auto bucket_view = gradapt::view_of<float>(bucket);
    const auto params =
        gradapt::param_list_of<float>(model, {.flags = [](const std::string&, const at::Tensor& v) {
                                        return gradapt::param_flags{.skip_weight_decay = v.dim() == 1};
                                      }});
    for (const auto& v : params.values()) comm.broadcast(v, 0);  // rank 0's initial weights

    const gradapt::host backend{.threads = 1};
    const gradapt::sgd opt({.momentum = 0.9, .weight_decay = c.weight_decay});
    auto opt_state = opt.init(backend, params);

    // K-FAC over both Linear layers; their gradients as views of .grad() (out x in, and out).
    const gradapt::kfac kf(c.kfac());
    const gradapt::host_lapack la{};
    const gradapt::kfac_layer layers[] = {{"fc1", dg::features, dg::hidden, true},
                                          {"fc2", dg::hidden, dg::classes, true}};
    auto kstate = kf.init<float>(la, layers);
    const gradapt::kfac_grad<float> grads[] = {
        {gradapt::view_of<float>(model.fc1->weight.grad()), gradapt::view_of<float>(model.fc1->bias.grad())},
        {gradapt::view_of<float>(model.fc2->weight.grad()), gradapt::view_of<float>(model.fc2->bias.grad())}};

    const double peak = lr;
    std::vector<int> idx(static_cast<std::size_t>(c.batch));
    at::Tensor index = at::empty({c.batch}, at::kLong);
    const auto evaluate = [&](long t) {
      if (rank != 0) return;
      at::NoGradGuard no_grad;
      const double acc = model.forward(test_x).argmax(1).eq(test_y).to(at::kDouble).mean().item<double>();
      if (acc >= c.target && !out.step_at_target) out.step_at_target = t;
      out.final_accuracy = acc;
    };

    for (long t = 0; t < c.steps; ++t) {
      if (t % c.eval_every == 0) evaluate(t);
      dg::batch_of(c.batch, P, s, t, rank, idx);
      std::copy(idx.begin(), idx.end(), index.data_ptr<std::int64_t>());
      const bool keep = use_kfac && kf.factor_update_due(kstate);

      bucket.zero_();  // in place: the views stay valid
      const at::Tensor loss =
          cross_entropy(model.forward(data.x.index_select(0, index), keep), data.y.index_select(0, index));
      loss.backward();  // runs the hooks: model.g holds dL/dy of both layers

      comm.allreduce(bucket_view, gradapt::reduce_op::sum);
      backend.apply([inv = 1.0f / static_cast<float>(P)](float& x) { x *= inv; }, bucket_view);
      const double lr_t = c.lr_at(t, peak);
      if (use_kfac) {
        if (keep) {
          for (std::size_t i = 0; i < 2; ++i) {
            examples::require(model.g[i].defined(), "torch_kfac: the hook of layer ", i, " did not run");
            // g of the mean loss is 1/rows of the per-example gradients: loss_scale = 1/rows.
            const double mean_scale = 1.0 / static_cast<double>(model.g[i].size(0));
            kf.accumulate(kstate, i, gradapt::view_of<const float>(model.a[i]),
                          gradapt::view_of<const float>(model.g[i]), mean_scale);
          }
        }
        kf.step(comm, kstate, grads, lr_t);  // rewrites the .grad() slices in place
      }
      opt.step(backend, params, opt_state, {.lr = lr_t});
    }
    evaluate(c.steps);
    decompositions[static_cast<std::size_t>(rank)] = kstate.decompositions();  // own slot

    // Are the replicas identical? Compare every parameter bit for bit with rank 0's.
    std::vector<float> mine, ref;
    for (const auto& v : params.values()) mine.insert(mine.end(), v.data(), v.data() + v.size());
    ref = mine;
    comm.broadcast(gradapt::host_view(ref), 0);
    double differ = std::memcmp(mine.data(), ref.data(), mine.size() * sizeof(float)) != 0 ? 1.0 : 0.0;
    comm.allreduce(gradapt::tensor_view<double, gradapt::host_space>::scalar(&differ),
                   gradapt::reduce_op::sum);
    if (rank == 0) {
      at::NoGradGuard no_grad;
      out.final_loss = cross_entropy(model.forward(train_x), train_y).item<double>();
      out.identical = differ == 0.0;
    }
  });
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto n : decompositions) out.decompositions += n;
  return out;
}

constexpr const char* options[] = {
    "--data",       "--ranks",  "--steps",     "--batch",   "--warmup",           "--weight-decay",
    "--target",     "--lr-sgd", "--lr-kfac",   "--damping", "--inv-update-steps", "--kl-clip",
    "--eval-every", "--seed",   "--init-seed", "--grid"};

/// `--grid 1`: both runs at every rate of the grid; prints, per rate, the first evaluated step
/// at the target accuracy ("-" when not reached) and the final accuracy ("diverged" when a
/// state became non-finite and a step threw), and each run's best rate (fewest steps, ties:
/// the higher final accuracy).
void grid(const tensors& data, const dg::split& s, const config& c) {
  const double rates[] = {1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0};
  std::printf(
      "\nfirst evaluated step at held-out accuracy >= %g / final held-out accuracy after %ld steps, by peak "
      "learning rate\n%-12s",
      c.target, c.steps, "lr");
  for (const double r : rates) std::printf(" %11g", r);
  std::printf("  best\n");
  for (const bool use_kfac : {false, true}) {
    std::printf("%-12s", use_kfac ? "K-FAC + SGD" : "SGD");
    std::fflush(stdout);
    long best_step = std::numeric_limits<long>::max();
    double best_acc = -1, best_lr = 0;
    for (const double r : rates) {
      run_result res;
      try {
        res = train(data, s, c, use_kfac, r);
      } catch (const gradapt::error&) {
        std::printf(" %11s", "diverged");
        std::fflush(stdout);
        continue;
      }
      char cell[32];
      if (res.step_at_target)
        std::snprintf(cell, sizeof cell, "%ld/%.3f", *res.step_at_target, res.final_accuracy);
      else
        std::snprintf(cell, sizeof cell, "-/%.3f", res.final_accuracy);
      std::printf(" %11s", cell);
      std::fflush(stdout);
      if (res.step_at_target && (*res.step_at_target < best_step ||
                                 (*res.step_at_target == best_step && res.final_accuracy > best_acc))) {
        best_step = *res.step_at_target;
        best_acc = res.final_accuracy;
        best_lr = r;
      }
    }
    if (best_acc < 0)
      std::printf("  none\n");
    else
      std::printf("  %g\n", best_lr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const examples::cli cl(argc, argv, "torch_kfac", options);
    const dg::dataset d = dg::load(cl.text("--data", GRADAPT_EXAMPLES_DATA_DIR "/digits.csv"), "torch_kfac");
    config c;
    c.ranks = static_cast<int>(cl.count("--ranks", c.ranks, 1));
    c.steps = cl.count("--steps", c.steps, 1);
    c.batch = static_cast<int>(cl.count("--batch", c.batch, 1));
    c.warmup = cl.count("--warmup", c.warmup, 0);
    c.weight_decay = cl.number("--weight-decay", c.weight_decay);
    c.target = cl.number("--target", c.target);
    examples::require(c.target <= 1, "torch_kfac: --target is ", c.target, " (expected an accuracy <= 1)");
    c.lr_sgd = cl.number("--lr-sgd", c.lr_sgd);
    c.lr_kfac = cl.number("--lr-kfac", c.lr_kfac);
    c.damping = cl.number("--damping", c.damping);
    c.kl_clip = cl.number("--kl-clip", c.kl_clip);
    c.inv_update_steps = static_cast<std::uint64_t>(cl.count("--inv-update-steps", 10, 1));
    c.eval_every = cl.count("--eval-every", c.eval_every, 1);
    c.seed = static_cast<unsigned>(cl.count("--seed", c.seed, 0));
    c.init_seed = static_cast<std::uint64_t>(cl.count("--init-seed", 1, 0));
    const bool run_grid = cl.count("--grid", 0, 0) != 0;
    gradapt::kfac::validate(c.kfac());  // names a bad option before any rank starts

    std::vector<int> all(static_cast<std::size_t>(d.n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937(c.seed));
    const std::size_t held_out = 300;
    examples::require(all.size() > held_out, "torch_kfac: the data holds ", all.size(),
                      " rows (expected more than ", held_out, ")");
    const dg::split s{std::vector<int>(all.begin(), all.end() - static_cast<std::ptrdiff_t>(held_out)),
                      std::vector<int>(all.end() - static_cast<std::ptrdiff_t>(held_out), all.end())};

    at::set_num_threads(1);  // one LibTorch thread per rank
    const tensors data = to_tensors(d);
    std::printf(
        "torch_kfac: torch::nn 64-32-10 MLP on %zu digits (%zu held out), %d ranks x %d examples per step, "
        "%ld "
        "steps, target held-out accuracy %g\n",
        s.train.size() + s.test.size(), s.test.size(), c.ranks, c.batch, c.steps, c.target);
    std::printf(
        "torch_kfac: K-FAC eigen, factors every step from forward inputs and register_hook output gradients "
        "(loss_scale 1/%d), decompositions every %llu steps, damping %g, kl_clip %g; SGD momentum 0.9\n",
        c.batch, static_cast<unsigned long long>(c.inv_update_steps), c.damping, c.kl_clip);

    if (run_grid) {
      grid(data, s, c);
      return 0;
    }
    const run_result runs[] = {train(data, s, c, false, c.lr_sgd), train(data, s, c, true, c.lr_kfac)};
    std::printf("\n%-12s %8s %10s %9s %8s %16s %8s\n", "optimizer", "peak lr", "final loss", "accuracy",
                "in sync", "step at target", "time s");
    for (const auto& r : runs) {
      const std::string st = r.step_at_target ? std::to_string(*r.step_at_target) : std::string("-");
      std::printf("%-12s %8g %10.5f %9.3f %8s %16s %8.2f\n", r.name, r.lr, r.final_loss, r.final_accuracy,
                  r.identical ? "yes" : "NO", st.c_str(), r.seconds);
    }
    std::printf("K-FAC + SGD: %llu layer decompositions over all ranks\n",
                static_cast<unsigned long long>(runs[1].decompositions));

    const bool in_sync = runs[0].identical && runs[1].identical && std::isfinite(runs[0].final_loss) &&
                         std::isfinite(runs[1].final_loss);
    const auto& sgd_at = runs[0].step_at_target;
    const auto& kfac_at = runs[1].step_at_target;
    const bool ok = sgd_at && kfac_at && *kfac_at < *sgd_at && in_sync;
    if (!sgd_at || !kfac_at)
      std::printf("torch_kfac: %s does not reach held-out accuracy %.3f in %ld steps: FAIL\n",
                  kfac_at ? "SGD" : "K-FAC + SGD", c.target, c.steps);
    else
      std::printf(
          "torch_kfac: K-FAC + SGD reaches held-out accuracy %.3f at step %ld, SGD at step %ld (%.2fx fewer "
          "steps), replicas bitwise identical: %s: %s\n",
          c.target, *kfac_at, *sgd_at,
          static_cast<double>(*sgd_at) / static_cast<double>(std::max(1L, *kfac_at)), in_sync ? "yes" : "NO",
          ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
