// Every option that shapes a distributed component's result is agreed across ranks through
// gradapt::agree_values: for each option of the bucket reducer, the hierarchy, the sharded
// optimizer (its sharding options and its chain's options) and the composed step's reduce and
// state slots, one rank of three built with another value makes construction an error on every
// rank, naming the option and the range of values across ranks, and no rank is left waiting in
// a collective. (K-FAC's and Shampoo's tables are in test_kfac.cpp and test_shampoo_dist.cpp.)
#include "catch.hpp"

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "gradapt/backend/host.hpp"
#include "gradapt/bucket/reducer.hpp"
#include "gradapt/comm/hierarchical.hpp"
#include "gradapt/comm/threads.hpp"
#include "gradapt/optim/adamw.hpp"
#include "gradapt/shard/optimizer.hpp"
#include "rank_errors.hpp"
#include "scenarios/bucket_reducer.hpp"

namespace gradapt_test_option_agreement {

using Catch::Matchers::Contains;
using gradapt::comm::threads;

namespace {

const gradapt::comm::threads_options quick{.timeout = std::chrono::seconds(30)};

/// One option changed on rank 1 of 3: `build(comm, differs)` constructs the component.
struct change {
  const char* option;  ///< the name the message must hold
  const char* values;  ///< "lo to hi" as the message prints the range
  std::function<void(threads&, bool)> build;
};

void require_every_rank_names(const change& c) {
  INFO(c.option);
  const auto what =
      gradapt_test::errors_of(3, quick, [&](threads& comm) { c.build(comm, comm.rank() == 1); });
  for (std::size_t r = 0; r < what.size(); ++r) {
    INFO("rank " << r << ": " << what[r]);
    CHECK_THAT(what[r], Contains(c.option) && Contains(c.values) && Contains("across ranks"));
  }
}

const std::vector<std::size_t> sizes{300, 5, 64};

}  // namespace

TEST_CASE("bucket::reducer: a one-rank difference in an option is an error on every rank naming it",
          "[agreement][bucket]") {
  const auto reducer_with = [](gradapt::bucket::reducer_options o) {
    return [o](threads& comm, bool) {
      const auto plan = gradapt::bucket::bucket_plan::make(bucket_scenarios::infos(sizes));
      auto g = bucket_scenarios::seeded_grads(sizes, comm.rank(), 0, std::normal_distribution<float>(0, 1),
                                              [](float x, std::size_t) { return x; });
      gradapt::bucket::reducer<threads, float> red(comm, plan, bucket_scenarios::views_of(g), o);
    };
  };
  for (const auto& c : std::vector<change>{
           {"reducer_options::average", "0 to 1",
            [&](threads&comm, bool d) { reducer_with({.average = !d})(comm, d); }},
           {"reducer_options::overlap", "0 to 1",
            [&](threads&comm, bool d) { reducer_with({.overlap = !d})(comm, d); }},
       })
    require_every_rank_names(c);
}

TEST_CASE("comm::hierarchy: a one-rank difference in an option is an error on every rank naming it",
          "[agreement][hierarchical]") {
  for (const auto& c : std::vector<change>{
           {"hierarchy_options::group_size", "1 to 3",
            [](threads&comm, bool d) {
              gradapt::comm::hierarchy<threads> h(comm, {.group_size = d ? 3 : 1});
            }},
           {"hierarchy_options::check_arguments", "0 to 1",
            [](threads&comm, bool d) {
              gradapt::comm::hierarchy<threads> h(comm, {.group_size = 1, .check_arguments = !d});
            }},
       })
    require_every_rank_names(c);
}

TEST_CASE(
    "shard::sharded_optimizer: a one-rank difference in a sharding or chain option is an error on every rank",
    "[agreement][shard]") {
  const auto init_with = [](gradapt::shard::sharded_options so, double wd) {
    return [so, wd](threads& comm) {
      std::vector<std::vector<float>> p, g;
      gradapt::param_list<float> params;
      p.reserve(sizes.size());
      g.reserve(sizes.size());
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        p.emplace_back(sizes[t], 0.5f);
        g.emplace_back(sizes[t], 0.25f);
        params.add("w" + std::to_string(t), gradapt::host_view(p.back()), gradapt::host_view(g.back()));
      }
      const gradapt::shard::sharded_optimizer opt{gradapt::adamw({.weight_decay = wd}), so};
      (void)opt.init(comm, gradapt::host{.threads = 1}, params);
    };
  };
  gradapt::shard::sharded_options base;
  base.partition.alignment = 64;
  const auto with = [&](auto edit) {
    return [&, edit](threads& comm, bool d) {
      auto so = base;
      if (d) edit(so);
      init_with(so, 0.01)(comm);
    };
  };
  for (const auto& c : std::vector<change>{
           {"partition_options::mode", "0 to 1",
            with([](auto&o) { o.partition.mode = gradapt::shard::granularity::tensor; })},
           {"partition_options::alignment", "32 to 64", with([](auto&o) { o.partition.alignment = 32; })},
           {"partition_options::align_tensors", "0 to 1",
            with([](auto&o) { o.partition.align_tensors = false; })},
           {"sharded_options::bucket_elements", "1000 to 1048576",
            with([](auto&o) { o.bucket_elements = 1000; })},
           {"sharded_options::check_interval", "7 to 100", with([](auto&o) { o.check_interval = 7; })},
           {"bucket_options::cap_bytes", "4096 to 26214400",
            with([](auto&o) { o.buckets.cap_bytes = 4096; })},
           {"bucket_options::first_cap_bytes", "512 to 1048576",
            with([](auto&o) { o.buckets.first_cap_bytes = 512; })},
           {"weight_decay", "0.01 to 0.02",
            [&](threads&comm, bool d) { init_with(base, d ? 0.02 : 0.01)(comm); }},
       })
    require_every_rank_names(c);
}

}  // namespace gradapt_test_option_agreement
