# Host tests: core types, the host backend, the single and threads communicators.
gradapt_add_test(test_dtype SOURCES test_dtype.cpp)
gradapt_add_test(test_tensor_view SOURCES test_tensor_view.cpp)
gradapt_add_test(test_param_list SOURCES test_param_list.cpp)
gradapt_add_test(test_host_backend SOURCES test_host_backend.cpp)
gradapt_add_test(test_comm SOURCES test_comm.cpp)
gradapt_add_test(test_chunking SOURCES test_chunking.cpp)
gradapt_add_test(test_shard_partition SOURCES test_shard_partition.cpp)
gradapt_add_test(test_bucket_plan SOURCES test_bucket_plan.cpp)
find_package(Threads REQUIRED)
target_link_libraries(test_comm PRIVATE Threads::Threads)
gradapt_add_test(test_bucket_reducer SOURCES test_bucket_reducer.cpp)
target_link_libraries(test_bucket_reducer PRIVATE Threads::Threads)
gradapt_add_test(test_shard_optimizer SOURCES test_shard_optimizer.cpp)
target_link_libraries(test_shard_optimizer PRIVATE Threads::Threads)
gradapt_add_test(test_shard_checkpoint_memory SOURCES test_shard_checkpoint_memory.cpp)
target_link_libraries(test_shard_checkpoint_memory PRIVATE Threads::Threads)
gradapt_add_test(test_shard_device_path SOURCES test_shard_device_path.cpp)
target_link_libraries(test_shard_device_path PRIVATE Threads::Threads)
gradapt_add_test(test_hierarchical SOURCES test_hierarchical.cpp)
target_link_libraries(test_hierarchical PRIVATE Threads::Threads)

# A consumer that includes only <gradapt/gradapt.hpp> must compile warning-free with g++ and
# clang++ at -Wall -Wextra -Wpedantic -Werror (no OpenMP, no -march): at -O2, and with g++ at
# the other levels a consumer's build types use (-O0 and -Og for debugging, -O1, -Os), where GCC
# inlines less around the host backend's AVX2 functions.
foreach(_cxx g++ clang++)
  find_program(GRADAPT_${_cxx}_EXE NAMES ${_cxx})
  if(GRADAPT_${_cxx}_EXE)
    add_test(NAME consumer_${_cxx}
      COMMAND ${GRADAPT_${_cxx}_EXE} -std=c++20 -O2 -Wall -Wextra -Wpedantic -Werror
              -I${PROJECT_SOURCE_DIR}/include -c ${CMAKE_CURRENT_SOURCE_DIR}/consumer.cpp
              -o ${CMAKE_CURRENT_BINARY_DIR}/consumer_${_cxx}.o)
  endif()
endforeach()
if(GRADAPT_g++_EXE)
  foreach(_level O0 Og O1 Os)
    add_test(NAME consumer_g++_${_level}
      COMMAND ${GRADAPT_g++_EXE} -std=c++20 -${_level} -Wall -Wextra -Wpedantic -Werror
              -I${PROJECT_SOURCE_DIR}/include -c ${CMAKE_CURRENT_SOURCE_DIR}/consumer.cpp
              -o ${CMAKE_CURRENT_BINARY_DIR}/consumer_g++_${_level}.o)
  endforeach()
endif()

# The explicit vector path and the scalar fallback of the host reductions give the same bits.
# (These path comparisons, here and for the optimizers below, run in the default preset only:
# GRADAPT_TEST_PATH_COMPARISONS is OFF in the sanitizer presets, whose other tests run the
# same code.)
if(GRADAPT_TEST_PATH_COMPARISONS)
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
endif()
gradapt_add_test(test_gradient_noise_scale SOURCES test_gradient_noise_scale.cpp)
target_link_libraries(test_gradient_noise_scale PRIVATE Threads::Threads)
gradapt_add_test(test_adascale SOURCES test_adascale.cpp)
gradapt_add_test(test_allreduce_with_norms SOURCES test_allreduce_with_norms.cpp)
target_link_libraries(test_allreduce_with_norms PRIVATE Threads::Threads)

# Install into a scratch prefix and build a consumer with find_package (the components this
# build enables that need no GPU, so the consumer can run here).
set(_consumer_components)
foreach(_c openmp mpi)
  string(TOUPPER ${_c} _C)
  if(GRADAPT_WITH_${_C})
    list(APPEND _consumer_components ${_c})
  endif()
endforeach()
if(GRADAPT_WITH_LAPACK)
  list(APPEND _consumer_components linalg)
endif()
if(GRADAPT_INSTALL)
  string(REPLACE ";" "\\;" _consumer_components_arg "${_consumer_components}")
  add_test(NAME install_and_consume
    COMMAND ${CMAKE_COMMAND} -DBUILD=${PROJECT_BINARY_DIR} -DWORK=${CMAKE_CURRENT_BINARY_DIR}/install_and_consume
            -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/install/consumer -DGEN=${CMAKE_GENERATOR} -DCXX=${CMAKE_CXX_COMPILER}
            -DCOMPONENTS=${_consumer_components_arg} -P ${CMAKE_CURRENT_SOURCE_DIR}/install/install_and_consume.cmake)
  set_tests_properties(install_and_consume PROPERTIES TIMEOUT 300 ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
endif()
# The CMake path of the vcpkg port (ports/gradapt): its configure options, install layout and a
# consumer of the relocated tree (the vcpkg tool itself is not available here).
if(GRADAPT_INSTALL)
  add_test(NAME vcpkg_port_layout
    COMMAND ${CMAKE_COMMAND} -DSRC=${PROJECT_SOURCE_DIR} -DWORK=${CMAKE_CURRENT_BINARY_DIR}/vcpkg_port_layout
            -DGEN=${CMAKE_GENERATOR} -DCXX=${CMAKE_CXX_COMPILER} -P ${CMAKE_CURRENT_SOURCE_DIR}/install/vcpkg_port_layout.cmake)
  set_tests_properties(vcpkg_port_layout PROPERTIES TIMEOUT 300 ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
endif()
gradapt_add_test(test_goodput SOURCES test_goodput.cpp)
find_package(Eigen3 3.3 QUIET NO_MODULE)
if(TARGET Eigen3::Eigen)
  gradapt_add_test(test_goodput_fit SOURCES test_goodput_fit.cpp)
  target_link_libraries(test_goodput_fit PRIVATE Eigen3::Eigen)
endif()
gradapt_add_test(test_local_sgd SOURCES test_local_sgd.cpp)
target_link_libraries(test_local_sgd PRIVATE Threads::Threads)
gradapt_add_test(test_straggler SOURCES test_straggler.cpp)
target_link_libraries(test_straggler PRIVATE Threads::Threads)
gradapt_add_test(test_elastic_policy SOURCES test_elastic_policy.cpp)
target_link_libraries(test_elastic_policy PRIVATE Threads::Threads)
gradapt_add_test(test_local_sgd_adaptive SOURCES test_local_sgd_adaptive.cpp)
target_link_libraries(test_local_sgd_adaptive PRIVATE Threads::Threads)
gradapt_add_test(test_loss_scaler SOURCES test_loss_scaler.cpp)
target_link_libraries(test_loss_scaler PRIVATE Threads::Threads)
target_compile_definitions(test_loss_scaler PRIVATE GRADAPT_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/tests/data")
gradapt_add_test(test_adasum SOURCES test_adasum.cpp)
target_link_libraries(test_adasum PRIVATE Threads::Threads)
gradapt_add_test(test_adasum_errors SOURCES test_adasum_errors.cpp)
target_link_libraries(test_adasum_errors PRIVATE Threads::Threads)
include(${CMAKE_CURRENT_SOURCE_DIR}/adapters.cmake)
# Optimizer chains and presets (optim/): optax/PyTorch reference vectors, chain properties,
# the SIMD pack type, and the pack path against the scalar path bit for bit.
gradapt_add_test(test_optim_refs SOURCES test_optim_refs.cpp)
target_compile_definitions(test_optim_refs PRIVATE GRADAPT_OPTIM_DATA="${PROJECT_SOURCE_DIR}/tests/data/optim")
gradapt_add_test(test_optim_chain SOURCES test_optim_chain.cpp)
gradapt_add_test(test_optim_large_gradients SOURCES test_optim_large_gradients.cpp)
gradapt_add_test(test_optim_chain_structure SOURCES test_optim_chain_structure.cpp)
gradapt_add_test(test_clip SOURCES test_clip.cpp GCC_NO_PCH)
target_link_libraries(test_clip PRIVATE Threads::Threads)
target_compile_definitions(test_clip PRIVATE GRADAPT_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/tests/data")
gradapt_add_test(test_optim_simd SOURCES test_optim_simd.cpp)
gradapt_add_test(test_simd_half SOURCES test_simd_half.cpp)
# The optimizers' pack paths (run-time AVX2, SSE2 only) and the scalar path give the same bits.
if(GRADAPT_TEST_PATH_COMPARISONS)
foreach(_mode vector sse scalar)
  add_executable(test_optim_bits_${_mode} test_optim_bits.cpp)
  target_link_libraries(test_optim_bits_${_mode} PRIVATE gradapt::gradapt)
  target_compile_options(test_optim_bits_${_mode} PRIVATE ${GRADAPT_TEST_WARNINGS})
  if(GRADAPT_WITH_OPENMP)
    target_link_libraries(test_optim_bits_${_mode} PRIVATE gradapt::openmp)
  endif()
endforeach()
target_compile_definitions(test_optim_bits_scalar PRIVATE GRADAPT_NO_VECTOR_EXTENSIONS)
target_compile_definitions(test_optim_bits_sse PRIVATE GRADAPT_NO_AVX2_DISPATCH)
add_test(NAME optim_pack_path_matches_scalar
  COMMAND ${CMAKE_COMMAND} -DA=$<TARGET_FILE:test_optim_bits_vector> -DB=$<TARGET_FILE:test_optim_bits_scalar>
          -DOUT=${CMAKE_CURRENT_BINARY_DIR}/optim_bits -P ${CMAKE_CURRENT_SOURCE_DIR}/compare_outputs.cmake)
add_test(NAME optim_sse_path_matches_scalar
  COMMAND ${CMAKE_COMMAND} -DA=$<TARGET_FILE:test_optim_bits_sse> -DB=$<TARGET_FILE:test_optim_bits_scalar>
          -DOUT=${CMAKE_CURRENT_BINARY_DIR}/optim_bits_sse -P ${CMAKE_CURRENT_SOURCE_DIR}/compare_outputs.cmake)
file(MAKE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/optim_bits ${CMAKE_CURRENT_BINARY_DIR}/optim_bits_sse)
endif()
# The composed data-parallel step (train/) on the threads communicator.
gradapt_add_test(test_train_step SOURCES test_train_step.cpp)
target_link_libraries(test_train_step PRIVATE Threads::Threads)
gradapt_add_test(test_train_resize SOURCES test_train_resize.cpp)
target_link_libraries(test_train_resize PRIVATE Threads::Threads)
gradapt_add_test(test_train_hetero SOURCES test_train_hetero.cpp)
target_link_libraries(test_train_hetero PRIVATE Threads::Threads)
# Ranks that disagree: every rank throws, none hangs (bounded by the threads watchdog).
gradapt_add_test(test_disagreement SOURCES test_disagreement.cpp)
target_link_libraries(test_disagreement PRIVATE Threads::Threads)
# 10,000 random cases of ranks that call different collectives, types, ops, counts or options.
gradapt_add_test(test_soak_disagreement SOURCES test_soak_disagreement.cpp)
target_link_libraries(test_soak_disagreement PRIVATE Threads::Threads)
# A backend defined in the test from the documented concepts only, against gradapt::host.
gradapt_add_test(test_backend_third_party SOURCES test_backend_third_party.cpp)
target_link_libraries(test_backend_third_party PRIVATE Threads::Threads)
# A combine policy and a stateful hook defined in the test, through the documented contract.
gradapt_add_test(test_train_policy SOURCES test_train_policy.cpp)
target_link_libraries(test_train_policy PRIVATE Threads::Threads)
gradapt_add_test(test_optim_adafactor SOURCES test_optim_adafactor.cpp)
gradapt_add_test(test_optim_factored_chain SOURCES test_optim_factored_chain.cpp)
gradapt_add_test(test_optim_factored_refs SOURCES test_optim_factored_refs.cpp)
target_compile_definitions(test_optim_factored_refs PRIVATE GRADAPT_FACTORED_DATA="${PROJECT_SOURCE_DIR}/tests/data/optim_factored")
gradapt_add_test(test_factored_backend SOURCES test_factored_backend.cpp)
gradapt_add_test(test_optim_sm3 SOURCES test_optim_sm3.cpp)
gradapt_add_test(test_archive SOURCES test_archive.cpp)
gradapt_add_test(test_checkpoint_bitflip SOURCES test_checkpoint_bitflip.cpp)
# The linear-algebra component (BLAS/LAPACK through gradapt::linalg): products, the symmetric
# eigensolver and inverse p-th roots.
if(GRADAPT_WITH_LAPACK)
  gradapt_add_test(test_linalg SOURCES test_linalg.cpp LIBS gradapt::linalg)
  gradapt_add_test(test_linalg_root SOURCES test_linalg_root.cpp LIBS gradapt::linalg)
  # Shampoo (optim/shampoo.hpp) on gradapt::host with host_lapack.
  gradapt_add_test(test_shampoo SOURCES test_shampoo.cpp LIBS gradapt::linalg)
  # Shampoo against DistributedShampoo trajectories (tests/data/shampoo, make_shampoo_refs.py).
  gradapt_add_test(test_shampoo_refs SOURCES test_shampoo_refs.cpp LIBS gradapt::linalg)
  target_compile_definitions(test_shampoo_refs PRIVATE GRADAPT_SHAMPOO_DATA="${PROJECT_SOURCE_DIR}/tests/data/shampoo")
  # Its matrices are at most 288 x 288: BLAS threads only add contention.
  if(TEST test_shampoo_refs)  # not registered in the tsan preset (it starts no threads)
    set_tests_properties(test_shampoo_refs PROPERTIES ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endif()
  # Shampoo's roots over comm::threads ranks and in its background thread.
  gradapt_add_test(test_shampoo_dist SOURCES test_shampoo_dist.cpp LIBS gradapt::linalg)
  target_link_libraries(test_shampoo_dist PRIVATE Threads::Threads)
  # K-FAC (optim/kfac.hpp): closed forms, long double references, comm::threads ranks.
  gradapt_add_test(test_kfac SOURCES test_kfac.cpp LIBS gradapt::linalg)
  target_link_libraries(test_kfac PRIVATE Threads::Threads)
  # K-FAC against kfac-pytorch's reference data (tests/data/make_kfac_refs.py).
  gradapt_add_test(test_kfac_refs SOURCES test_kfac_refs.cpp LIBS gradapt::linalg)
  target_compile_definitions(test_kfac_refs PRIVATE GRADAPT_KFAC_DATA="${PROJECT_SOURCE_DIR}/tests/data/kfac")
  # K-FAC in the precondition slot of train::data_parallel_step (train/kfac_policy.hpp).
  gradapt_add_test(test_train_kfac SOURCES test_train_kfac.cpp LIBS gradapt::linalg)
  target_link_libraries(test_train_kfac PRIVATE Threads::Threads)
endif()
# cuda_linalg (cuBLAS + cuSOLVER) on the device: compiled with the CUDA tests' runner, skipped
# at run time without a GPU (exit code 77).
if(GRADAPT_WITH_CUDA)
  add_executable(test_linalg_cuda test_linalg_cuda.cu)
  target_link_libraries(test_linalg_cuda PRIVATE gradapt::cuda_linalg gradapt_cuda_test_main)
  if(GRADAPT_WARNINGS_AS_ERRORS)
    set(_linalg_cuda_flags -Xcompiler=-Wall,-Wextra,-Werror --Werror=all-warnings)
  else()
    set(_linalg_cuda_flags -Xcompiler=-Wall,-Wextra)
  endif()
  target_compile_options(test_linalg_cuda PRIVATE ${_linalg_cuda_flags})
  add_test(NAME test_linalg_cuda COMMAND test_linalg_cuda)
  set_tests_properties(test_linalg_cuda PROPERTIES SKIP_RETURN_CODE 77 LABELS cuda)
endif()
