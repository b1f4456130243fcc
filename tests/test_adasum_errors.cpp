// Adasum (gradapt/combine/adasum.hpp) on the threads communicator: errors on every rank
// (lists and workspaces that differ across ranks, invalid options, adasum_combine's sizes),
// empty lists, repeated calls (the same bits, no allocation in the steady state), and
// param_list gradients on comm::single. References: tests/support/adasum_fixtures.hpp.
#include "adasum_fixtures.hpp"

#include "alloc_counter.hpp"  // this executable's operator new counts allocations

namespace gradapt_test_adasum_errors {

using namespace adasum_test;

TEST_CASE("adasum: lists that differ across ranks throw on every rank", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  // Rank 2 has 6 elements in tensor 1 instead of 5.
  run_threads(4, [](threads& comm) {
    std::vector<float> x(3, 1.0f), y(comm.rank() == 2 ? 6 : 5, 1.0f);
    std::vector<tensor_view<float>> list = {gradapt::host_view(x), gradapt::host_view(y)};
    gradapt::adasum_workspace<float> ws(list);
    gradapt::adasum<threads> ada(comm);
    RANK_REQUIRE_THROWS_WITH(
        ada.allreduce(gradapt::host{.threads = 1}, list, ws),
        Contains("differ across ranks") && Contains("on rank " + std::to_string(comm.rank())));
  });
  // The same totals but different sizes.
  run_threads(3, [](threads& comm) {
    std::vector<float> x(comm.rank() == 1 ? 4 : 3, 1.0f), y(comm.rank() == 1 ? 4 : 5, 1.0f);
    std::vector<tensor_view<float>> list = {gradapt::host_view(x), gradapt::host_view(y)};
    gradapt::adasum_workspace<float> ws(list);
    gradapt::adasum<threads> ada(comm);
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{.threads = 1}, list, ws),
                             Contains("tensor sizes differ across ranks"));
  });
  // Rank 1 has one tensor more.
  run_threads(3, [](threads& comm) {
    std::vector<float> x(3, 1.0f), y(5, 1.0f);
    std::vector<tensor_view<float>> list = {gradapt::host_view(x)};
    if (comm.rank() == 1) list.push_back(gradapt::host_view(y));
    gradapt::adasum_workspace<float> ws(list);
    gradapt::adasum<threads> ada(comm);
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{.threads = 1}, list, ws),
                             Contains("tensor lists differ across ranks") && Contains("tensors"));
  });
}

TEST_CASE("adasum: a workspace made for another list throws on every rank", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  run_threads(3, [](threads& comm) {
    std::vector<double> x(7, 1.0), other(8, 1.0);
    std::vector<tensor_view<double>> list = {gradapt::host_view(x)};
    std::vector<tensor_view<double>> other_list = {gradapt::host_view(other)};
    gradapt::adasum_workspace<double> ws(comm.rank() == 0 ? other_list : list);
    gradapt::adasum<threads> ada(comm);
    if (comm.rank() == 0)
      RANK_REQUIRE_THROWS_WITH(
          ada.allreduce(gradapt::host{}, list, ws),
          Contains("adasum::allreduce on rank 0: tensor 0 has 7 elements but the workspace "
                   "was made for 8"));
    else
      RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{}, list, ws),
                               Contains("rank 0 passed invalid input"));
  });
  // Without the agreement, the bad rank throws alone (here every rank is bad, so none waits).
  run_threads(2, [](threads& comm) {
    std::vector<double> x(7, 1.0);
    std::vector<tensor_view<double>> list = {gradapt::host_view(x), gradapt::host_view(x)};
    std::vector<tensor_view<double>> shorter = {gradapt::host_view(x)};
    gradapt::adasum_workspace<double> ws(shorter);
    gradapt::adasum<threads> ada(comm, {.check_layout = false});
    RANK_REQUIRE_THROWS_WITH(ada.allreduce(gradapt::host{}, list, ws),
                             Contains("the list holds 2 tensors but the workspace was made for 1"));
  });
}

TEST_CASE("adasum: invalid options throw before any collective", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  gradapt::comm::single one;
  using A = gradapt::adasum<gradapt::comm::single>;
  REQUIRE_THROWS_WITH((A(one, {.zero_threshold = -1.0})), Contains("zero_threshold is -1"));
  REQUIRE_THROWS_WITH((A(one, {.zero_threshold = std::nan("")})), Contains("zero_threshold"));
  REQUIRE_THROWS_WITH((A(one, {.zero_threshold = std::numeric_limits<double>::infinity()})),
                      Contains("finite"));
  REQUIRE_THROWS_WITH((A(one, {.mode = adasum_mode::hierarchical, .group_size = 0})),
                      Contains("group_size is 0"));
  REQUIRE_THROWS_WITH((A(one, {.group_size = 2})), Contains("but mode is flat"));
  // Workspace buffers that are too small.
  std::vector<float> x(9), e(10), ok(11);
  std::vector<double> s(17), enough(18);
  std::vector<tensor_view<float>> list = {gradapt::host_view(x)};
  using W = gradapt::adasum_workspace<float>;
  REQUIRE(W::elements_needed(list) == 11);
  REQUIRE(W::scalars_needed(list) == 18);
  REQUIRE_THROWS_WITH(W(list, gradapt::host_view(e), gradapt::host_view(enough)),
                      Contains("element buffer has 10 elements but a list of 9 elements needs 11"));
  REQUIRE_THROWS_WITH(W(list, gradapt::host_view(ok), gradapt::host_view(s)),
                      Contains("scalar buffer has 17 doubles but a list of 1 tensors needs 18"));
  // Borrowed buffers work like owned ones.
  W borrowed(list, gradapt::host_view(ok), gradapt::host_view(enough));
  REQUIRE(borrowed.total_elements() == 9);
  A single_rank(one);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  single_rank.allreduce(gradapt::host{}, list, borrowed);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(x[i] == static_cast<float>(i));
}

TEST_CASE("adasum: empty lists and lists of empty tensors are no-ops", "[adasum]") {
  run_threads(5, [](threads& comm) {
    std::vector<tensor_view<float>> none;
    gradapt::adasum_workspace<float> ws(none);
    gradapt::adasum<threads> ada(comm);
    ada.allreduce(gradapt::host{}, none, ws);
    std::vector<float> empty;
    std::vector<tensor_view<float>> empties = {gradapt::host_view(empty), gradapt::host_view(empty)};
    gradapt::adasum_workspace<float> ws2(empties);
    ada.allreduce(gradapt::host{}, empties, ws2);
    RANK_REQUIRE(ws2.total_elements() == 0);
  });
}

TEST_CASE("adasum: repeated calls give the same bits and the steady state allocates nothing", "[adasum]") {
  const std::vector<std::size_t> sizes = {500, 3, 0, 77};
  for (int n : {3, 4}) {
    const auto inputs = rank_inputs<float>(n, sizes, 8);
    std::vector<std::size_t> allocations(static_cast<std::size_t>(n));
    std::vector<tlist<float>> first(static_cast<std::size_t>(n)), second(static_cast<std::size_t>(n));
    for (const bool one_buffer : {false, true})
      run_threads(n, [&](threads& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        rank_tensors<float> mine(inputs[r], one_buffer);
        gradapt::adasum_workspace<float> ws(mine.views);
        gradapt::adasum<threads> ada(comm);
        const gradapt::host b{.threads = 1};
        ada.allreduce(b, mine.views, ws);
        first[r] = mine.values();
        rank_tensors<float> again(inputs[r], one_buffer);
        // Same layout, new buffers: the workspace serves any list of this layout.
        const std::size_t before = alloc_counter::on_this_thread();
        ada.allreduce(b, again.views, ws);
        allocations[r] = alloc_counter::on_this_thread() - before;
        second[r] = again.values();
      });
    for (int r = 0; r < n; ++r) {
      INFO("ranks " << n << ", rank " << r);
      REQUIRE(allocations[r] == 0);
      REQUIRE(first_difference(first[r], second[r]) == -1);
    }
  }
}

TEMPLATE_TEST_CASE("adasum_combine: the pairwise operator on one rank", "[adasum]", float, double,
                   gradapt::half) {
  using T = TestType;
  const std::vector<std::size_t> sizes = {40, 1, 0, 4100};
  auto a = random_list<T>(sizes, 31);
  const auto b = random_list<T>(sizes, 32);
  rank_tensors<T> ra(a, false), rb(b, true);
  std::vector<tensor_view<const T>> bviews(rb.views.begin(), rb.views.end());
  gradapt::adasum_workspace<T> ws(ra.views);
  gradapt::adasum_combine(gradapt::host{}, ra.views, bviews, ws);
  // Whole-tensor dot products: the serial combine at depth 0.
  REQUIRE(first_difference(ra.values(), serial<T>{}.combine(a, b, 0)) == -1);
  REQUIRE(worst_ratio(ra.values(), ld_combine(widen(a), widen(b), 0), std::vector<tlist<T>>{a, b}) <= 1.0);
  // a (+) a = a.
  rank_tensors<T> same(a, false), copy(a, true);
  gradapt::adasum_combine(gradapt::host{}, same.views, copy.views, ws);
  REQUIRE(first_difference(same.values(), a) == -1);
}

TEST_CASE("adasum_combine: errors name the tensor and both sizes", "[adasum][errors]") {
  using Catch::Matchers::Contains;
  std::vector<float> x(4), y(5), z(4);
  std::vector<tensor_view<float>> a = {gradapt::host_view(x)}, b = {gradapt::host_view(y)},
                                  two = {gradapt::host_view(x), gradapt::host_view(z)},
                                  c = {gradapt::host_view(z)};
  gradapt::adasum_workspace<float> ws(a);
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, b, ws),
                      Contains("tensor 0 has 4 elements in a but 5 in b"));
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, two, ws),
                      Contains("a holds 1 tensors but b holds 2"));
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, c, ws, -0.5), Contains("zero_threshold"));
  gradapt::adasum_workspace<float> wrong(two);
  REQUIRE_THROWS_WITH(gradapt::adasum_combine(gradapt::host{}, a, c, wrong),
                      Contains("the list holds 1 tensors but the workspace was made for 2"));
}

TEST_CASE("adasum: param_list gradients and comm::single", "[adasum]") {
  std::vector<float> w(6, 0.0f), g(6);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * static_cast<float>(i);
  gradapt::param_list<float> params;
  params.add("w", gradapt::host_view(w), gradapt::host_view(g));
  gradapt::adasum_workspace<float> ws(params.grads());
  gradapt::comm::single one;
  gradapt::adasum<gradapt::comm::single> ada(one);
  ada.allreduce(gradapt::host{}, params.grads(), ws);
  for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == 0.5f * static_cast<float>(i));
}

}  // namespace gradapt_test_adasum_errors
