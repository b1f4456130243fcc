// Catch2 v2 main for test executables that need no special start-up (Catch's implementation
// is compiled once, in catch_session.cpp).
#include "catch_session.hpp"

int main(int argc, char** argv) { return gradapt_test::run_catch(argc, argv); }
