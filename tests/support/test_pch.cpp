// The translation unit of gradapt_test_pch: the target that compiles the tests' precompiled
// header (tests/CMakeLists.txt), which the test executables reuse. It holds no code.
