// testing.h — shared helpers for the tests: random data, error norms, finite differences.
//
// Gradient checks follow one pattern: the CPU reference kernels are templates over the scalar
// type, so the forward runs in double for central finite differences while the analytic
// backward runs in float (the production path). A scalar loss L = sum_j w_j * out_j with random
// weights w turns any op into a scalar function.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace bb::test {

// Deterministic random values from the Philox stream (seed, offset).
inline std::vector<float> randn(size_t n, uint64_t seed, float std = 1.0f, uint64_t offset = 0) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std * philox_normal(seed, offset + i);
  return v;
}
inline std::vector<float> randu(size_t n, uint64_t seed, float lo, float hi, uint64_t offset = 0) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = lo + (hi - lo) * philox_uniform(seed, offset + i);
  return v;
}
template <class To, class From>
std::vector<To> cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// ||a - b|| / ||b||; requires ||b|| > 0 so that a check is never made against zeros.
template <class A, class B>
double rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  EXPECT_GT(den, 0.0) << "reference is all zeros: the comparison would prove nothing";
  return std::sqrt(num) / std::sqrt(den > 0 ? den : 1.0);
}

template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

// Central finite differences of a scalar function of x, in double: df/dx_i.
inline std::vector<double> finite_diff(const std::function<double(const std::vector<double>&)>& f,
                                       std::vector<double> x, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// sum_j w_j * out_j in double.
template <class T>
double weighted_sum(const std::vector<T>& out, const std::vector<double>& w) {
  double s = 0;
  for (size_t j = 0; j < out.size(); ++j) s += static_cast<double>(out[j]) * w[j];
  return s;
}

// Gradient tolerance used everywhere: fp32 analytic backward vs double finite differences.
constexpr double kGradTol = 1e-3;

// Expects `fn` to throw bb::Error whose message contains `needle`.
template <class Fn>
void expect_error_contains(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << needle << "', got none";
  } catch (const bb::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message was: " << e.what() << "\nexpected to contain: " << needle;
  }
}

}  // namespace bb::test
