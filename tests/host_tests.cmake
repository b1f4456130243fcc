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

# The explicit vector path and the scalar fallback of the host reductions give the same bits.
foreach(_mode vector scalar)
  add_executable(reduction_bits_${_mode} reduction_bits.cpp)
  target_link_libraries(reduction_bits_${_mode} PRIVATE gradapt::gradapt)
  target_compile_options(reduction_bits_${_mode} PRIVATE ${GRADAPT_TEST_WARNINGS})
  if(GRADAPT_WITH_OPENMP)
    target_link_libraries(reduction_bits_${_mode} PRIVATE gradapt::openmp)
  endif()
endforeach()
target_compile_definitions(reduction_bits_scalar PRIVATE GRADAPT_NO_VECTOR_EXTENSIONS)
add_test(NAME host_vector_path_matches_scalar
  COMMAND ${CMAKE_COMMAND} -DA=$<TARGET_FILE:reduction_bits_vector> -DB=$<TARGET_FILE:reduction_bits_scalar>
          -DOUT=${CMAKE_CURRENT_BINARY_DIR} -P ${CMAKE_CURRENT_SOURCE_DIR}/compare_outputs.cmake)
