// A decoder-only character-level transformer in torch::nn, trained data-parallel under MPI
// (one process per rank, comm::mpi) with gradapt's composed step: the optimizer state sharded
// over the ranks (zero_state<2>), AdamW (gradapt::adamw) and dynamic loss scaling
// (gradapt::loss_scaler). bench/ddp_transformer.py trains the same model on the same data with
// the same seeds and hyperparameters under PyTorch's DistributedDataParallel (gloo) and
// torch.optim.AdamW; scripts/compare-ddp.sh runs both (docs/performance.md, "LibTorch
// transformer against PyTorch DDP").
//
// Gradients reach the step during LibTorch's backward pass: every parameter's .grad() is a
// slice of one flat tensor (gradapt::param_list_of views it), and a post-hook on the
// parameter's AccumulateGrad node (the node DDP's reducer hooks) calls step.mark_ready(index)
// as soon as autograd has accumulated that gradient into its slice. With zero_state<2> each
// full bucket (DDP's rule: reverse registration order, 1 MiB first, then 25 MiB) has its
// reduce-scatter started there (MPI_Ireduce_scatter_block, `sharded_options::overlap`; with
// `--overlap 0` it runs blocking inside the hook) and finished by step(); `--state replicated` instead runs
// bucket_reduce with overlap (non-blocking allreduces that proceed while the backward goes on)
// over the replicated state. step.step() then finishes the step.
//
// Model: byte vocabulary (256), learned positions, pre-LayerNorm blocks (causal self-attention
// written out with matmul/softmax, GELU MLP of 4 d), final LayerNorm, untied head; by default
// d 256, 4 layers, 4 heads, context 64: 3.3 M parameters. Corpus: 300,000 characters of text
// generated from a fixed seed (words of random letters, each word followed by one of 8 words
// that depend on it), by the same splitmix64 stream as the Python side. Batches: the data seed
// starts one splitmix64 stream; each step draws world x batch window offsets from it, and rank
// r takes the r-th group of `batch`, so every rank trains on its own windows. Initial weights:
// at::manual_seed(init seed), then N(0, 0.02) for matrices, 1 for LayerNorm weights, 0 for
// biases, in named_parameters() order: identical on every rank and in the Python program.
//
//   mpirun -np N torch_transformer [--steps 200] [--warmup 5] [--batch 8] [--lr 1e-3]
//        [--warmup-lr 20] [--weight-decay 0.1] [--data-seed 1] [--init-seed 0] [--layers 4]
//        [--d-model 256] [--heads 4] [--context 64]
//        [--state zero2|replicated] [--check-sizes 0|1] [--overlap 0|1] [--csv FILE]
//
// At the end rank 0 prints the mean step time (forward + backward + step over the steps after
// the warm-up, each step's time taken on its slowest rank), the optimizer-state bytes per rank
// (step_metrics::state_bytes), the final loss (mean over ranks, mean of the last 10 steps)
// and whether every rank holds bitwise identical parameters (a hash of the bytes, agreed by
// allreduce). The CSV holds step, loss (mean over ranks), step time (max over ranks).
#include <mpi.h>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <gradapt/adapters/torch.hpp>
#include <gradapt/comm/mpi.hpp>
#include <gradapt/gradapt.hpp>
#include <gradapt/optim/adamw.hpp>
#include <gradapt/precision/loss_scaler.hpp>
#include <gradapt/train/data_parallel_step.hpp>

#include "common/check.hpp"

namespace {

namespace train = gradapt::train;

struct options {
  int steps = 200, warmup = 5, batch = 8, layers = 4, d_model = 256, heads = 4, context = 64;
  int warmup_lr = 20;  // steps of linear learning-rate warm-up
  double lr = 1e-3, weight_decay = 0.1;
  std::uint64_t data_seed = 1, init_seed = 0;
  std::string state = "zero2", csv;
  bool check_sizes = true;  // comm::mpi's argument agreement before every collective
  bool overlap = true;      // zero2: each bucket's reduce-scatter started in its hook, finished in step()
};

// ---- data: the same splitmix64 stream as bench/ddp_transformer.py ----------------------------

/// splitmix64 (Steele, Lea, Flood 2014): the generator both programs share.
struct splitmix64 {
  std::uint64_t s;
  std::uint64_t next() {
    s += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
};

/// The corpus: 200 words of 2 to 7 random lower-case letters; sentences of 4 to 12 words in
/// which word w is followed by word (31 w + 7 + k) mod 200, k one of 8; a capital first letter,
/// ". " after each sentence and a line break after every fifth.
std::string make_corpus(std::size_t chars) {
  splitmix64 rng{12345};
  constexpr std::uint64_t n_words = 200;
  std::vector<std::string> words;
  for (std::uint64_t i = 0; i < n_words; ++i) {
    const std::uint64_t len = 2 + rng.next() % 6;
    std::string w;
    for (std::uint64_t j = 0; j < len; ++j) w += static_cast<char>('a' + rng.next() % 26);
    words.push_back(w);
  }
  std::string text;
  std::uint64_t w = rng.next() % n_words, sentences = 0;
  while (text.size() < chars) {
    const std::uint64_t len = 4 + rng.next() % 9;
    for (std::uint64_t i = 0; i < len; ++i) {
      std::string word = words[w];
      if (i == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
      text += word;
      text += i + 1 == len ? ". " : " ";
      w = (31 * w + 7 + rng.next() % 8) % n_words;
    }
    if (++sentences % 5 == 0) text += '\n';
  }
  text.resize(chars);
  return text;
}

// ---- the model ------------------------------------------------------------------------------

struct block_impl : torch::nn::Module {
  block_impl(int d, int heads)
      : heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc(register_module("fc", torch::nn::Linear(d, 4 * d))),
        out(register_module("out", torch::nn::Linear(4 * d, d))) {}

  /// x [B, T, C]; `mask` [T, T] is true above the diagonal (the future).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) {
    const std::int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    const at::Tensor h = qkv(ln1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    const at::Tensor q = h[0], k = h[1], v = h[2];
    at::Tensor att = q.matmul(k.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(hd)));
    att = att.masked_fill(mask, -std::numeric_limits<double>::infinity()).softmax(-1);
    const at::Tensor y = att.matmul(v).transpose(1, 2).reshape({B, T, C});
    const at::Tensor x1 = x + proj(y);
    return x1 + out(at::gelu(fc(ln2(x1))));
  }

  std::int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};

struct transformer_impl : torch::nn::Module {
  explicit transformer_impl(const options& o)
      : tok(register_module("tok", torch::nn::Embedding(256, o.d_model))),
        pos(register_module("pos", torch::nn::Embedding(o.context, o.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})))),
        head(register_module("head",
                             torch::nn::Linear(torch::nn::LinearOptions(o.d_model, 256).bias(false)))) {
    for (int i = 0; i < o.layers; ++i) blocks->push_back(std::make_shared<block_impl>(o.d_model, o.heads));
    mask = at::ones({o.context, o.context}, at::kBool).triu(1);
  }

  /// Logits [B, T, 256] of the byte sequences idx [B, T].
  at::Tensor forward(const at::Tensor& idx) {
    const std::int64_t T = idx.size(1);
    at::Tensor x = tok(idx) + pos(at::arange(T, at::kLong));
    const at::Tensor m = mask.narrow(0, 0, T).narrow(1, 0, T);
    for (const auto& b : *blocks) x = b->as<block_impl>()->forward(x, m);
    return head(ln_f(x));
  }

  /// The shared initialisation (see the file comment), in named_parameters() order.
  void init(std::uint64_t seed) {
    at::NoGradGuard no_grad;
    at::manual_seed(seed);
    for (auto& item : named_parameters(true)) {
      at::Tensor p = item.value();
      const std::string& name = item.key();
      if (p.dim() >= 2)
        p.normal_(0.0, 0.02);
      else if (name.ends_with(".weight"))
        p.fill_(1.0);
      else
        p.zero_();
    }
  }

  torch::nn::Embedding tok, pos;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
  at::Tensor mask;
};

/// A post-hook of a parameter's AccumulateGrad node: runs after autograd has accumulated the
/// parameter's gradient into its .grad() (here a slice of the flat gradient tensor).
struct ready_hook : torch::autograd::FunctionPostHook {
  explicit ready_hook(std::function<void()> f) : on_ready(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready();
    return outputs;
  }
  std::function<void()> on_ready;
};

/// FNV-1a over the bytes of every parameter, folded to 52 bits (exact in a double).
double parameter_hash(const gradapt::param_list<float>& params) {
  std::uint64_t h = 1469598103934665603ULL;
  for (const auto& v : params.values()) {
    const auto* b = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ULL;
  }
  return static_cast<double>(h >> 12);
}

struct result {
  double mean_step = 0, final_loss = 0;
  std::uint64_t state_bytes_max = 0, state_bytes_rank0 = 0, skipped = 0;
  bool identical = false;
  std::vector<double> parts;  ///< forward, backward, inside mark_ready, step(): slowest rank's mean
};

/// Trains on this rank; `State` is the state slot's policy, `Reduce` the reduce slot's.
template <class State, class Reduce>
result run(gradapt::comm::mpi& comm, const options& o, const std::string& corpus, State state,
           Reduce reduce) {
  const int world = comm.size(), rank = comm.rank();
  const std::thread::id main_thread = std::this_thread::get_id();

  transformer_impl model(o);
  model.init(o.init_seed);

  // Every .grad() a slice of one flat tensor; autograd accumulates into it in place.
  std::int64_t total = 0;
  for (const auto& p : model.parameters()) total += p.numel();
  at::Tensor flat = at::zeros({total}, at::kFloat);
  std::int64_t offset = 0;
  for (auto& p : model.parameters()) {
    p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
  }
  const auto params = gradapt::param_list_of<float>(model);

  auto step = train::make_data_parallel_step(
      comm, gradapt::host{.threads = 1}, params,
      gradapt::adamw({.lr = o.lr, .b1 = 0.9, .b2 = 0.999, .eps = 1e-8, .weight_decay = o.weight_decay}),
      {.lr = o.lr, .local_batch = static_cast<double>(o.batch)},
      gradapt::loss_scaler({.init_scale = 65536.0}), state, reduce);

  // One AccumulateGrad post-hook per parameter, in param_list order (named_parameters()).
  // The nodes are held here: a parameter keeps only a weak reference to its accumulator.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  double in_hooks = 0;  // seconds inside mark_ready (unscale, bucket collectives)
  std::size_t index = 0;
  for (const auto& item : model.named_parameters(true)) {
    auto acc = torch::autograd::impl::grad_accumulator(item.value());
    examples::require(acc != nullptr, "torch_transformer: no gradient accumulator for '", item.key(), "'");
    acc->add_post_hook(std::make_unique<ready_hook>([&step, &main_thread, &in_hooks, t = index] {
      // MPI is initialised FUNNELED: LibTorch runs a CPU backward pass on the calling thread.
      if (std::this_thread::get_id() != main_thread)
        examples::fail("torch_transformer: the backward pass ran a hook on another thread");
      const auto h0 = std::chrono::steady_clock::now();
      step.mark_ready(t);
      in_hooks += std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count();
    }));
    accumulators.push_back(std::move(acc));
    ++index;
  }
  examples::require(index == params.size(), "torch_transformer: ", index, " hooks for ", params.size(),
                    " gradients");

  const auto n = static_cast<std::uint64_t>(corpus.size()) - static_cast<std::uint64_t>(o.context) - 1;
  splitmix64 data{o.data_seed};
  at::Tensor x = at::empty({o.batch, o.context}, at::kLong), y = at::empty({o.batch, o.context}, at::kLong);
  std::vector<double> losses(static_cast<std::size_t>(o.steps)), times(static_cast<std::size_t>(o.steps));
  using clock = std::chrono::steady_clock;
  // Mean seconds per step after the warm-up: forward, backward, inside mark_ready, step().
  std::vector<double> parts(4, 0.0);
  for (int t = 0; t < o.steps; ++t) {
    // The step's windows: world x batch offsets from the stream; this rank's are group `rank`.
    auto* xs = x.data_ptr<std::int64_t>();
    auto* ys = y.data_ptr<std::int64_t>();
    for (int r = 0; r < world; ++r)
      for (int b = 0; b < o.batch; ++b) {
        const std::uint64_t off = data.next() % n;
        if (r != rank) continue;
        for (int i = 0; i < o.context; ++i) {
          xs[b * o.context + i] = static_cast<unsigned char>(corpus[off + static_cast<std::uint64_t>(i)]);
          ys[b * o.context + i] = static_cast<unsigned char>(corpus[off + static_cast<std::uint64_t>(i) + 1]);
        }
      }
    const double lr = o.lr * std::min(1.0, static_cast<double>(t + 1) / o.warmup_lr);

    const auto t0 = clock::now();
    flat.zero_();
    const at::Tensor logits = model.forward(x);
    const at::Tensor loss = torch::nn::functional::cross_entropy(logits.view({-1, 256}), y.view({-1}));
    const auto t1 = clock::now();
    const double hooks_before = in_hooks;
    loss.mul(step.loss_scale()).backward();  // the hooks mark each gradient as it is accumulated
    const auto t2 = clock::now();
    const double l = loss.item<double>();
    step.step({.lr = lr, .loss = l});
    const auto t3 = clock::now();
    times[static_cast<std::size_t>(t)] = std::chrono::duration<double>(t3 - t0).count();
    if (t >= o.warmup) {
      const double w = 1.0 / (o.steps - o.warmup);
      parts[0] += w * std::chrono::duration<double>(t1 - t0).count();
      parts[1] += w * std::chrono::duration<double>(t2 - t1).count();
      parts[2] += w * (in_hooks - hooks_before);
      parts[3] += w * std::chrono::duration<double>(t3 - t2).count();
    }
    losses[static_cast<std::size_t>(t)] = l;
  }

  // Per step: the mean loss over the ranks and the slowest rank's time (two collectives, after
  // the timed loop).
  comm.allreduce(gradapt::host_view(losses), gradapt::reduce_op::sum);
  comm.allreduce(gradapt::host_view(times), gradapt::reduce_op::max);
  for (double& l : losses) l /= world;

  result out;
  for (int t = o.warmup; t < o.steps; ++t)
    out.mean_step += times[static_cast<std::size_t>(t)] / (o.steps - o.warmup);
  const int tail = std::min(10, o.steps);
  for (int t = o.steps - tail; t < o.steps; ++t) out.final_loss += losses[static_cast<std::size_t>(t)] / tail;

  std::vector<double> bytes{static_cast<double>(step.state_bytes())};
  out.state_bytes_rank0 = step.state_bytes();
  comm.allreduce(gradapt::host_view(bytes), gradapt::reduce_op::max);
  out.state_bytes_max = static_cast<std::uint64_t>(bytes[0]);
  out.skipped = step.metrics().step - step.metrics().optimizer_steps;

  // Bitwise identical replicas: the largest hash equals the smallest.
  std::vector<double> h{parameter_hash(params), -parameter_hash(params)};
  comm.allreduce(gradapt::host_view(h), gradapt::reduce_op::max);
  out.identical = h[0] == -h[1];

  if (rank == 0 && !o.csv.empty()) {
    std::FILE* f = std::fopen(o.csv.c_str(), "w");
    examples::require(f != nullptr, "torch_transformer: cannot write '", o.csv, "'");
    std::fprintf(f, "step,loss,step_seconds\n");
    for (int t = 0; t < o.steps; ++t)
      std::fprintf(f, "%d,%.6f,%.6f\n", t + 1, losses[static_cast<std::size_t>(t)],
                   times[static_cast<std::size_t>(t)]);
    std::fclose(f);
  }
  comm.allreduce(gradapt::host_view(parts), gradapt::reduce_op::max);
  out.parts = parts;
  if (rank == 0)
    std::printf("torch_transformer: %d ranks x %d sequences of %d bytes, %lld parameters in %zu tensors\n",
                world, o.batch, o.context, static_cast<long long>(total), params.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  if (provided < MPI_THREAD_FUNNELED) MPI_Abort(MPI_COMM_WORLD, 1);
  int code = 0;
  try {
    options o;
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      examples::require(i + 1 < argc, "torch_transformer: ", a, " needs a value");
      const std::string v = argv[++i];
      if (a == "--steps")
        o.steps = std::stoi(v);
      else if (a == "--warmup")
        o.warmup = std::stoi(v);
      else if (a == "--batch")
        o.batch = std::stoi(v);
      else if (a == "--lr")
        o.lr = std::stod(v);
      else if (a == "--warmup-lr")
        o.warmup_lr = std::stoi(v);
      else if (a == "--weight-decay")
        o.weight_decay = std::stod(v);
      else if (a == "--data-seed")
        o.data_seed = std::stoull(v);
      else if (a == "--init-seed")
        o.init_seed = std::stoull(v);
      else if (a == "--layers")
        o.layers = std::stoi(v);
      else if (a == "--d-model")
        o.d_model = std::stoi(v);
      else if (a == "--heads")
        o.heads = std::stoi(v);
      else if (a == "--context")
        o.context = std::stoi(v);
      else if (a == "--state")
        o.state = v;
      else if (a == "--csv")
        o.csv = v;
      else if (a == "--check-sizes")
        o.check_sizes = v != "0";
      else if (a == "--overlap")
        o.overlap = v != "0";
      else
        examples::fail("torch_transformer: unknown option ", a,
                       " (options: --steps --warmup --batch --lr --warmup-lr --weight-decay --data-seed "
                       "--init-seed --layers --d-model --heads "
                       "--context --state zero2|replicated --check-sizes 0|1 --overlap 0|1 --csv FILE)");
    }
    examples::require(o.warmup_lr >= 1, "torch_transformer: --warmup-lr is ", o.warmup_lr,
                      " (expected >= 1)");
    examples::require(o.steps > o.warmup && o.warmup >= 0, "torch_transformer: --steps ", o.steps,
                      " must exceed --warmup ", o.warmup);
    examples::require(o.d_model % o.heads == 0, "torch_transformer: --d-model ", o.d_model,
                      " is not a multiple of --heads ", o.heads);
    at::set_num_threads(1);
    gradapt::comm::mpi comm(MPI_COMM_WORLD, {.check_sizes = o.check_sizes});
    const std::string corpus = make_corpus(300000);
    result r;
    std::string recipe;
    if (o.state == "zero2") {
      r = run(comm, o, corpus, train::zero_state<2>{.sharding = {.overlap = o.overlap}},
              train::one_buffer_reduce{});
      recipe = o.overlap
                   ? "ZeRO-2 (buckets' reduce-scatters started in the backward's hooks, finished in step())"
                   : "ZeRO-2 (buckets reduce-scattered, blocking, in the backward's hooks)";
    } else if (o.state == "replicated") {
      r = run(comm, o, corpus, train::replicated_state{}, train::bucket_reduce{.overlap = true});
      recipe = "replicated state, bucket_reduce with overlap";
    } else {
      examples::fail("torch_transformer: --state is '", o.state, "' (expected zero2 or replicated)");
    }
    if (comm.rank() == 0) {
      std::printf("torch_transformer: gradapt %s + AdamW + loss scaling, %d steps\n", recipe.c_str(),
                  o.steps);
      std::printf(
          "mean step time: %.2f ms (steps %d..%d, forward + backward + step, each step's slowest rank)\n",
          1e3 * r.mean_step, o.warmup + 1, o.steps);
      std::printf(
          "breakdown: forward %.2f ms, backward %.2f ms (of which mark_ready %.2f ms), step() %.2f ms "
          "(each the slowest rank's mean)\n",
          1e3 * r.parts[0], 1e3 * r.parts[1], 1e3 * r.parts[2], 1e3 * r.parts[3]);
      std::printf("optimizer state bytes per rank: %llu (largest rank), %llu (rank 0)\n",
                  static_cast<unsigned long long>(r.state_bytes_max),
                  static_cast<unsigned long long>(r.state_bytes_rank0));
      std::printf("final loss: %.4f (mean over ranks, last 10 steps; %llu skipped steps)\n", r.final_loss,
                  static_cast<unsigned long long>(r.skipped));
      std::printf("replicas bitwise identical: %s\n", r.identical ? "yes" : "no");
    }
    if (!r.identical) code = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}
