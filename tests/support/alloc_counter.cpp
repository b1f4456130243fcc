// The allocation counter's replacements of the global operator new / delete family (see
// alloc_counter.hpp), compiled once per test executable that counts allocations.
#define GRADAPT_TEST_ALLOC_COUNTER_DEFINITIONS
#include "alloc_counter.hpp"
