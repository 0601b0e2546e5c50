// Catch2 2.x (Debian 12) and 3.x (Ubuntu 24.04) differ in headers and main; the tests
// include this file and nothing else from Catch2.
#pragma once
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#else
#include <catch2/catch.hpp>
#endif
