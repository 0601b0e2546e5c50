// Catch2's session, compiled once for every test binary (Catch2 2.x builds its whole runner
// in the file that defines DPT_CATCH_MAIN: the slowest file of the tests to compile).
#define DPT_CATCH_MAIN
#include "catch.hpp"

int dpt_test_run(int argc, char** argv) { return dpt_test::run_tests(argc, argv); }
