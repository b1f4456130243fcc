// Eigen adapter (adapters/eigen.hpp): views alias Eigen's storage (writes through the view are
// read back through Eigen's own indexing), shapes follow the storage order, constness
// follows the object, non-contiguous storage throws, and Eigen's 16-bit types share gradapt's
// bit layout (checked value by value against Eigen's own conversions).
#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "gradapt/adapters/eigen.hpp"
#include "gradapt/backend/host.hpp"

namespace gradapt_test_adapter_eigen {

using Catch::Matchers::Contains;
using gradapt::host_space;
using gradapt::tensor_view;
using gradapt::view_of;

namespace {

/// Fills a matrix-like object with distinct values 1, 2, 3, ... in Eigen's (i, j) order.
template <class M>
void fill_distinct(M& m) {
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j)
      m(i, j) = static_cast<typename M::Scalar>(1 + i * m.cols() + j);
}

template <class T>
std::uint16_t bits16(const T& v) {
  static_assert(sizeof(T) == 2);
  std::uint16_t u;
  std::memcpy(&u, &v, 2);
  return u;
}

}  // namespace

TEST_CASE("column-major matrices are row-major [cols, rows] views of the same memory", "[adapters][eigen]") {
  Eigen::MatrixXf m(3, 4);
  fill_distinct(m);
  auto v = view_of(m);
  STATIC_REQUIRE(std::is_same_v<decltype(v), tensor_view<float, host_space>>);
  REQUIRE(v.data() == m.data());
  REQUIRE(v.shape_string() == "[4, 3]");
  // view element (j, i) is m(i, j)
  for (Eigen::Index i = 0; i < 3; ++i)
    for (Eigen::Index j = 0; j < 4; ++j) REQUIRE(v[static_cast<std::size_t>(j * 3 + i)] == m(i, j));
  // write through the view, read back through Eigen
  v[static_cast<std::size_t>(2 * 3 + 1)] = -7.5f;  // (j = 2, i = 1)
  REQUIRE(m(1, 2) == -7.5f);

  // the transpose of a column-major matrix is row-major with the same storage
  auto t = view_of(m.transpose());
  REQUIRE(t.data() == m.data());
  REQUIRE(t.shape_string() == "[4, 3]");
}

TEST_CASE("row-major matrices keep Eigen's [rows, cols]", "[adapters][eigen]") {
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m(2, 5);
  fill_distinct(m);
  auto v = view_of(m);
  STATIC_REQUIRE(std::is_same_v<decltype(v), tensor_view<double, host_space>>);
  REQUIRE(v.shape_string() == "[2, 5]");
  for (Eigen::Index i = 0; i < 2; ++i)
    for (Eigen::Index j = 0; j < 5; ++j) REQUIRE(v[static_cast<std::size_t>(i * 5 + j)] == m(i, j));
  v[7] = 100.0;  // (1, 2)
  REQUIRE(m(1, 2) == 100.0);

  // fixed-size types
  Eigen::Matrix3f f3 = Eigen::Matrix3f::Zero();
  REQUIRE(view_of(f3).shape_string() == "[3, 3]");
  Eigen::Matrix<float, 2, 3, Eigen::RowMajor> f23;
  REQUIRE(view_of(f23).shape_string() == "[2, 3]");
  Eigen::Matrix<float, 2, 3> c23;
  REQUIRE(view_of(c23).shape_string() == "[3, 2]");
}

TEST_CASE("vector types are rank 1; arrays behave like matrices", "[adapters][eigen]") {
  Eigen::VectorXf col(6);
  Eigen::RowVectorXd row(5);
  Eigen::Vector4f fixed;
  Eigen::ArrayXf arr(7);
  Eigen::ArrayXXd arr2(2, 3);
  REQUIRE(view_of(col).shape_string() == "[6]");
  REQUIRE(view_of(row).shape_string() == "[5]");
  REQUIRE(view_of(fixed).shape_string() == "[4]");
  REQUIRE(view_of(arr).shape_string() == "[7]");
  REQUIRE(view_of(arr2).shape_string() == "[3, 2]");
  view_of(arr)[6] = 3.0f;
  REQUIRE(arr(6) == 3.0f);

  // a dynamic matrix with one column stays rank 2
  Eigen::MatrixXf one(4, 1);
  REQUIRE(view_of(one).shape_string() == "[1, 4]");

  // empty objects give empty views
  Eigen::VectorXf empty;
  REQUIRE(view_of(empty).size() == 0);
  Eigen::MatrixXd none(0, 3);
  REQUIRE(view_of(none).shape_string() == "[3, 0]");
  REQUIRE(view_of(none).size() == 0);
}

TEST_CASE("maps, refs and contiguous blocks alias the underlying buffer", "[adapters][eigen]") {
  std::vector<float> buf(12);
  Eigen::Map<Eigen::MatrixXf> map(buf.data(), 3, 4);
  auto v = view_of(map);
  REQUIRE(v.data() == buf.data());
  REQUIRE(v.shape_string() == "[4, 3]");
  v[5] = 2.0f;
  REQUIRE(map(2, 1) == 2.0f);
  REQUIRE(buf[5] == 2.0f);

  Eigen::Map<const Eigen::VectorXf> cmap(buf.data(), 12);
  auto cv = view_of(cmap);
  STATIC_REQUIRE(std::is_same_v<decltype(cv), tensor_view<const float, host_space>>);
  REQUIRE(cv[5] == 2.0f);

  Eigen::MatrixXf m(3, 4);
  fill_distinct(m);
  Eigen::Ref<Eigen::MatrixXf> ref(m);
  REQUIRE(view_of(ref).data() == m.data());
  const Eigen::Ref<const Eigen::MatrixXf> cref(m);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(cref)), tensor_view<const float, host_space>>);

  // a column of a column-major matrix, and a range of whole columns, are contiguous
  auto c2 = view_of(m.col(2));
  REQUIRE(c2.shape_string() == "[3]");
  REQUIRE(c2.data() == &m(0, 2));
  c2[1] = -1.0f;
  REQUIRE(m(1, 2) == -1.0f);
  auto mid = view_of(m.middleCols(1, 2));
  REQUIRE(mid.shape_string() == "[2, 3]");
  REQUIRE(mid.data() == &m(0, 1));
  Eigen::VectorXf vec = Eigen::VectorXf::LinSpaced(8, 0.0f, 7.0f);
  auto seg = view_of(vec.segment(2, 3));
  REQUIRE(seg.shape_string() == "[3]");
  REQUIRE(seg[0] == 2.0f);

  // rows of a row-major matrix
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> r(4, 3);
  fill_distinct(r);
  auto top = view_of(r.topRows(2));
  REQUIRE(top.shape_string() == "[2, 3]");
  REQUIRE(top[5] == r(1, 2));
  REQUIRE(view_of(r.row(3)).data() == &r(3, 0));

  // a block of a const matrix is read-only
  const Eigen::MatrixXf& cm = m;
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(cm.col(0))), tensor_view<const float, host_space>>);
  STATIC_REQUIRE(std::is_same_v<decltype(view_of(cm)), tensor_view<const float, host_space>>);
}

TEST_CASE("non-contiguous Eigen storage throws with the strides and what to do",
          "[adapters][eigen][errors]") {
  Eigen::MatrixXf m(3, 4);
  fill_distinct(m);
  // a row of a column-major matrix: elements are rows() apart
  REQUIRE_THROWS_WITH(view_of(m.row(1)),
                      Contains("elements are 3 apart") && Contains("copy it into a vector"));
  // a sub-block: outer stride of the parent
  REQUIRE_THROWS_WITH(view_of(m.block(0, 0, 2, 2)),
                      Contains("column-major 2 x 2") &&
                          Contains("outer stride is 3 but the inner size is 2") &&
                          Contains("copy it into a Matrix"));
  // a one-row dynamic block of a column-major matrix: inner size 1, outer stride 3
  REQUIRE_THROWS_WITH(view_of(m.block(1, 0, 1, 3)), Contains("outer stride is 3 but the inner size is 1"));
  // padded and strided maps
  std::vector<double> buf(16);
  Eigen::Map<Eigen::MatrixXd, 0, Eigen::OuterStride<>> padded(buf.data(), 3, 2, Eigen::OuterStride<>(4));
  REQUIRE_THROWS_WITH(view_of(padded), Contains("outer stride is 4 but the inner size is 3"));
  Eigen::Map<Eigen::VectorXd, 0, Eigen::InnerStride<2>> strided(buf.data(), 5);
  REQUIRE_THROWS_WITH(view_of(strided), Contains("elements are 2 apart"));
  Eigen::Map<Eigen::MatrixXd, 0, Eigen::Stride<6, 2>> both(buf.data(), 3, 2);
  REQUIRE_THROWS_WITH(view_of(both), Contains("inner stride is 2"));
  // ... but a padded map of one column, a strided map of one element and empty blocks are fine
  Eigen::Map<Eigen::MatrixXd, 0, Eigen::OuterStride<>> one_col(buf.data(), 3, 1, Eigen::OuterStride<>(4));
  REQUIRE(view_of(one_col).shape_string() == "[1, 3]");
  Eigen::Map<Eigen::VectorXd, 0, Eigen::InnerStride<2>> single(buf.data(), 1);
  REQUIRE(view_of(single).size() == 1);
  REQUIRE(view_of(m.block(0, 0, 0, 2)).size() == 0);
}

TEST_CASE("eigen_viewable: what view_of accepts at compile time", "[adapters][eigen]") {
  using M = Eigen::MatrixXf;
  STATIC_REQUIRE(gradapt::eigen_viewable<M&>);
  STATIC_REQUIRE(gradapt::eigen_viewable<const M&>);
  STATIC_REQUIRE(!gradapt::eigen_viewable<M>);                    // an owning temporary would dangle
  STATIC_REQUIRE(!gradapt::eigen_viewable<M&&>);                  // the same, as an xvalue
  STATIC_REQUIRE(gradapt::eigen_viewable<Eigen::Map<M>>);         // an rvalue map is fine
  STATIC_REQUIRE(gradapt::eigen_viewable<Eigen::Ref<M>>);         // and a writable Ref (never copies)
  STATIC_REQUIRE(!gradapt::eigen_viewable<Eigen::Ref<const M>>);  // may hold a private copy
  STATIC_REQUIRE(gradapt::eigen_viewable<const Eigen::Ref<const M>&>);
  STATIC_REQUIRE(gradapt::eigen_viewable<decltype(std::declval<M&>().col(0))>);
  STATIC_REQUIRE(gradapt::eigen_viewable<decltype(std::declval<M&>().transpose())>);
  // expressions without storage, unsupported scalars and non-Eigen types
  STATIC_REQUIRE(!gradapt::eigen_viewable<decltype(std::declval<M&>() + std::declval<M&>())>);
  STATIC_REQUIRE(!gradapt::eigen_viewable<decltype(M::Zero(2, 2))>);
  STATIC_REQUIRE(!gradapt::eigen_viewable<Eigen::MatrixXi&>);
  STATIC_REQUIRE(!gradapt::eigen_viewable<Eigen::MatrixXcf&>);
  STATIC_REQUIRE(!gradapt::eigen_viewable<std::vector<float>&>);
  STATIC_REQUIRE(gradapt::eigen_dense<decltype(M::Zero(2, 2))>);
}

TEST_CASE("Eigen::half and Eigen::bfloat16 have gradapt's bit layout", "[adapters][eigen][dtype]") {
  // Every finite, infinite and NaN pattern: Eigen's value of the bits equals gradapt's.
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const auto u = static_cast<std::uint16_t>(b);
    const float eh = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(u));
    const float gh = static_cast<float>(gradapt::half::from_bits(u));
    const float eb = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(u));
    const float gb = static_cast<float>(gradapt::bfloat16::from_bits(u));
    if (std::isnan(eh) || std::isnan(gh)) {
      REQUIRE((std::isnan(eh) && std::isnan(gh)));
    } else if (eh != gh || std::signbit(eh) != std::signbit(gh)) {
      FAIL("half bits " << b << ": Eigen " << eh << ", gradapt " << gh);
    }
    if (std::isnan(eb) || std::isnan(gb)) {
      REQUIRE((std::isnan(eb) && std::isnan(gb)));
    } else if (eb != gb || std::signbit(eb) != std::signbit(gb)) {
      FAIL("bfloat16 bits " << b << ": Eigen " << eb << ", gradapt " << gb);
    }
  }
  // Rounding: Eigen's float -> 16-bit conversion and gradapt's agree on random and edge values
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 20);
  for (int k = 0; k < 20000; ++k) {
    const float f = std::ldexp(mant(rng), expo(rng));
    REQUIRE(bits16(Eigen::half(f)) == gradapt::half(f).bits);
    REQUIRE(bits16(Eigen::bfloat16(f)) == gradapt::bfloat16(f).bits);
  }
}

TEST_CASE("16-bit Eigen matrices are viewed as gradapt::half / bfloat16 in place",
          "[adapters][eigen][dtype]") {
  Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic> h(2, 3);
  for (Eigen::Index i = 0; i < h.size(); ++i) h.data()[i] = Eigen::half(0.25f * static_cast<float>(i) - 0.5f);
  auto hv = view_of(h);
  STATIC_REQUIRE(std::is_same_v<decltype(hv), tensor_view<gradapt::half, host_space>>);
  REQUIRE(static_cast<const void*>(hv.data()) == static_cast<const void*>(h.data()));
  REQUIRE(hv.shape_string() == "[3, 2]");
  // y = 3 y + 1 through the host backend; Eigen reads the results back and recomputes them
  const Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic> before = h;
  gradapt::host{.threads = 1}.apply([](float& y) { y = 3.0f * y + 1.0f; }, hv);
  for (Eigen::Index i = 0; i < h.size(); ++i) {
    const float x = static_cast<float>(before.data()[i]);
    REQUIRE(bits16(h.data()[i]) == bits16(Eigen::half(3.0f * x + 1.0f)));
  }

  Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1> b(5);
  for (Eigen::Index i = 0; i < b.size(); ++i) b(i) = Eigen::bfloat16(1.0f / static_cast<float>(i + 1));
  auto bv = view_of(b);
  STATIC_REQUIRE(std::is_same_v<decltype(bv), tensor_view<gradapt::bfloat16, host_space>>);
  for (Eigen::Index i = 0; i < b.size(); ++i)
    REQUIRE(static_cast<float>(bv[static_cast<std::size_t>(i)]) == static_cast<float>(b(i)));
  bv[4] = gradapt::bfloat16(-2.5f);
  REQUIRE(static_cast<float>(b(4)) == -2.5f);
}

TEST_CASE("Eigen views feed the host backend (reductions against long double)", "[adapters][eigen]") {
  std::mt19937 rng(3);
  std::normal_distribution<double> nd;
  Eigen::MatrixXd m(37, 29);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = nd(rng);
  long double ref = 0;
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j) ref += static_cast<long double>(m(i, j)) * m(i, j);
  const gradapt::host backend{.threads = 2};
  const tensor_view<const double> cv = view_of(m);
  const double got = backend.reduce(gradapt::reduction::sum_squares, cv);
  REQUIRE(std::abs(got - static_cast<double>(ref)) <= 1e-12 * static_cast<double>(ref));
  // axpy through views of two Eigen objects of different storage order but the same memory order
  Eigen::MatrixXd y = Eigen::MatrixXd::Ones(37, 29);
  backend.apply([](double& a, double b) { a += 2.0 * b; }, view_of(y), cv);
  const Eigen::MatrixXd expect = Eigen::MatrixXd::Ones(37, 29) + 2.0 * m;
  REQUIRE(y == expect);
}

}  // namespace gradapt_test_adapter_eigen
