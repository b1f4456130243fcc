# Host tests: core types, the host backend, the single and threads communicators.
gradapt_add_test(test_dtype SOURCES test_dtype.cpp)
gradapt_add_test(test_tensor_view SOURCES test_tensor_view.cpp)
gradapt_add_test(test_param_list SOURCES test_param_list.cpp)
gradapt_add_test(test_host_backend SOURCES test_host_backend.cpp)
gradapt_add_test(test_comm SOURCES test_comm.cpp)
gradapt_add_test(test_chunking SOURCES test_chunking.cpp)
find_package(Threads REQUIRED)
target_link_libraries(test_comm PRIVATE Threads::Threads)

# A consumer that includes only <gradapt/gradapt.hpp> must compile warning-free with g++ and
# clang++ at -Wall -Wextra -Wpedantic -Werror (no OpenMP, no -march).
foreach(_cxx g++ clang++)
  find_program(GRADAPT_${_cxx}_EXE NAMES ${_cxx})
  if(GRADAPT_${_cxx}_EXE)
    add_test(NAME consumer_${_cxx}
      COMMAND ${GRADAPT_${_cxx}_EXE} -std=c++20 -O2 -Wall -Wextra -Wpedantic -Werror
              -I${PROJECT_SOURCE_DIR}/include -c ${CMAKE_CURRENT_SOURCE_DIR}/consumer.cpp
              -o ${CMAKE_CURRENT_BINARY_DIR}/consumer_${_cxx}.o)
  endif()
endforeach()
