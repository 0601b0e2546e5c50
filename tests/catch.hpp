// Catch2 2.x (Debian 12) and 3.x (Ubuntu 24.04, the GPU machine) differ in headers, in
// main and in some names. Every test includes this file and nothing else from Catch2, and
// names nothing of Catch2's own (`Catch::...`) outside it: tests/catch_use_test.py checks
// that, so a test that builds with one major builds with the other.
//   - the whole of Catch2 in both majors: macros, generators, matchers (CHECK_THROWS_WITH
//     needs the matchers in 3.x);
//   - dpt_test::contains(text): a string matcher ("Contains" in 2.x, "ContainsSubstring"
//     in 3.x, where "Contains" matches ranges);
//   - dpt_test::run_tests(argc, argv): the session (define DPT_CATCH_MAIN before including,
//     in catch_main.cpp alone: 2.x builds its runner there).
#pragma once
#include <string>

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define DPT_CATCH_MAJOR 3
#else
#ifdef DPT_CATCH_MAIN
#define CATCH_CONFIG_RUNNER
#endif
#include <catch2/catch.hpp>
#define DPT_CATCH_MAJOR 2
#endif

namespace dpt_test {

// CHECK_THROWS_WITH(expr, dpt_test::contains("part of the message"))
inline auto contains(const std::string& text) {
#if DPT_CATCH_MAJOR == 3
  return Catch::Matchers::ContainsSubstring(text);
#else
  return Catch::Matchers::Contains(text);
#endif
}

#ifdef DPT_CATCH_MAIN  // 2.x defines its Session in the runner's translation unit alone
inline int run_tests(int argc, char** argv) { return Catch::Session().run(argc, argv); }
#endif

}  // namespace dpt_test
