# Host tests: core types, the host backend, the single and threads communicators.
gradapt_add_test(test_dtype GROUP core SOURCES test_dtype.cpp)
gradapt_add_test(test_tensor_view GROUP core SOURCES test_tensor_view.cpp)
gradapt_add_test(test_param_list GROUP core SOURCES test_param_list.cpp)
gradapt_add_test(test_host_backend GROUP core SOURCES test_host_backend.cpp)
gradapt_add_test(test_comm GROUP core SOURCES test_comm.cpp)
gradapt_add_test(test_chunking GROUP core SOURCES test_chunking.cpp)
gradapt_add_test(test_shard_partition GROUP core SOURCES test_shard_partition.cpp)
gradapt_add_test(test_bucket_plan GROUP core SOURCES test_bucket_plan.cpp)
find_package(Threads REQUIRED)
gradapt_add_test(test_bucket_reducer GROUP core SOURCES test_bucket_reducer.cpp)
gradapt_add_test(test_shard_optimizer GROUP optim SOURCES test_shard_optimizer.cpp)
gradapt_add_test(test_shard_checkpoint_memory GROUP optim SOURCES test_shard_checkpoint_memory.cpp)
gradapt_add_test(test_shard_device_path GROUP optim SOURCES test_shard_device_path.cpp)
gradapt_add_test(test_hierarchical GROUP core SOURCES test_hierarchical.cpp)

# A consumer that includes only <gradapt/gradapt.hpp> must compile warning-free with g++ and
# clang++ at -Wall -Wextra -Wpedantic -Werror (no OpenMP, no -march): at -O2, and with g++ at
# the other levels a consumer's build types use (-O0 and -Og for debugging, -O1, -Os), where GCC
# inlines less around the host backend's AVX2 functions.
# These compile commands do not depend on the preset's compiler or flags, so the sanitizer presets
# (GRADAPT_TEST_CONSUMERS OFF) leave them to the default preset instead of running them again.
option(GRADAPT_TEST_CONSUMERS "Compile tests/consumer.cpp with g++ and clang++ as ctests" ON)
if(GRADAPT_TEST_CONSUMERS)
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
endif()

# Negative compile tests: every invalid slot combination of the composed step fails to compile
# with a message naming both slots (tests/compile_fail/check.cmake reads the expected messages
# from the source).
if(GRADAPT_TEST_CONSUMERS)
  foreach(_src train_slots)
    add_test(NAME compile_fail_${_src}
      COMMAND ${CMAKE_COMMAND} -DCXX=${CMAKE_CXX_COMPILER} -DINCLUDE=${PROJECT_SOURCE_DIR}/include
              -DSOURCE=${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/${_src}.cpp
              -P ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/check.cmake)
  endforeach()
endif()

# The explicit vector path and the scalar fallback of the host reductions give the same bits.
# (These path comparisons, here and for the optimizers below, run in the default preset only:
# GRADAPT_TEST_PATH_COMPARISONS is OFF in the sanitizer presets, whose other tests run the
# same code.)
# gradapt_add_path_programs(name source): name_vector (the explicit pack paths) and name_scalar
# (-DGRADAPT_NO_VECTOR_EXTENSIONS), two builds of one bit-printing program.
function(gradapt_add_path_programs name source)
  foreach(_mode vector scalar)
    add_executable(${name}_${_mode} ${source})
    target_link_libraries(${name}_${_mode} PRIVATE gradapt::gradapt)
    target_compile_options(${name}_${_mode} PRIVATE ${GRADAPT_TEST_WARNINGS})
    if(GRADAPT_WITH_OPENMP)
      target_link_libraries(${name}_${_mode} PRIVATE gradapt::openmp)
    endif()
  endforeach()
  target_compile_definitions(${name}_scalar PRIVATE GRADAPT_NO_VECTOR_EXTENSIONS)
endfunction()
if(GRADAPT_TEST_PATH_COMPARISONS)
gradapt_add_path_programs(reduction_bits reduction_bits.cpp)
add_test(NAME host_vector_path_matches_scalar
  COMMAND ${CMAKE_COMMAND} -DA=$<TARGET_FILE:reduction_bits_vector> -DB=$<TARGET_FILE:reduction_bits_scalar>
          -DOUT=${CMAKE_CURRENT_BINARY_DIR} -P ${CMAKE_CURRENT_SOURCE_DIR}/compare_outputs.cmake)
endif()
gradapt_add_test(test_gradient_noise_scale GROUP core SOURCES test_gradient_noise_scale.cpp)
gradapt_add_test(test_adascale GROUP core SOURCES test_adascale.cpp)
gradapt_add_test(test_allreduce_with_norms GROUP core SOURCES test_allreduce_with_norms.cpp)

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
gradapt_add_test(test_goodput GROUP core SOURCES test_goodput.cpp)
find_package(Eigen3 3.3 QUIET NO_MODULE)
if(TARGET Eigen3::Eigen)
  gradapt_add_test(test_goodput_fit SOURCES test_goodput_fit.cpp)
  target_link_libraries(test_goodput_fit PRIVATE Eigen3::Eigen)
endif()
gradapt_add_test(test_local_sgd GROUP core SOURCES test_local_sgd.cpp)
gradapt_add_test(test_straggler GROUP core SOURCES test_straggler.cpp)
gradapt_add_test(test_elastic_policy GROUP core SOURCES test_elastic_policy.cpp)
gradapt_add_test(test_local_sgd_adaptive GROUP core SOURCES test_local_sgd_adaptive.cpp)
gradapt_add_test(test_loss_scaler GROUP core SOURCES test_loss_scaler.cpp)
gradapt_add_test(test_adasum GROUP core SOURCES test_adasum.cpp)
gradapt_add_test(test_adasum_errors GROUP core SOURCES test_adasum_errors.cpp)
include(${CMAKE_CURRENT_SOURCE_DIR}/adapters.cmake)
# Optimizer chains and presets (optim/): optax/PyTorch reference vectors, chain properties,
# the SIMD pack type, and the pack path against the scalar path bit for bit.
gradapt_add_test(test_optim_refs GROUP optim SOURCES test_optim_refs.cpp)
gradapt_add_test(test_optim_chain GROUP optim SOURCES test_optim_chain.cpp)
gradapt_add_test(test_optim_large_gradients GROUP optim SOURCES test_optim_large_gradients.cpp)
gradapt_add_test(test_optim_chain_structure GROUP optim SOURCES test_optim_chain_structure.cpp)
gradapt_add_test(test_clip SOURCES test_clip.cpp GCC_NO_PCH)
gradapt_add_test(test_optim_simd GROUP core SOURCES test_optim_simd.cpp)
gradapt_add_test(test_simd_half GROUP core SOURCES test_simd_half.cpp)
# The optimizers' pack paths (run-time AVX2, and SSE2 only through GRADAPT_HOST_AVX2=0 in the
# same binary) and the scalar path give the same bits; the program names the path it ran on
# standard error, and the SSE2 comparison checks that it ran the 16-byte path.
if(GRADAPT_TEST_PATH_COMPARISONS)
gradapt_add_path_programs(test_optim_bits test_optim_bits.cpp)
add_test(NAME optim_pack_path_matches_scalar
  COMMAND ${CMAKE_COMMAND} -DA=$<TARGET_FILE:test_optim_bits_vector> -DB=$<TARGET_FILE:test_optim_bits_scalar>
          -DOUT=${CMAKE_CURRENT_BINARY_DIR}/optim_bits -P ${CMAKE_CURRENT_SOURCE_DIR}/compare_outputs.cmake)
add_test(NAME optim_sse_path_matches_scalar
  COMMAND ${CMAKE_COMMAND} -DA=$<TARGET_FILE:test_optim_bits_vector> -DB=$<TARGET_FILE:test_optim_bits_scalar>
          "-DA_STDERR=host path: 16-byte packs" -DOUT=${CMAKE_CURRENT_BINARY_DIR}/optim_bits_sse
          -P ${CMAKE_CURRENT_SOURCE_DIR}/compare_outputs.cmake)
set_tests_properties(optim_sse_path_matches_scalar PROPERTIES ENVIRONMENT "GRADAPT_HOST_AVX2=0")
file(MAKE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/optim_bits ${CMAKE_CURRENT_BINARY_DIR}/optim_bits_sse)
endif()
# The composed data-parallel step (train/) on the threads communicator.
gradapt_add_test(test_train_step GROUP core SOURCES test_train_step.cpp)
gradapt_add_test(test_train_resize GROUP core SOURCES test_train_resize.cpp)
gradapt_add_test(test_train_hetero GROUP core SOURCES test_train_hetero.cpp)
gradapt_add_test(test_train_zero GROUP core SOURCES test_train_zero.cpp)
gradapt_add_test(test_train_combinations GROUP core SOURCES test_train_combinations.cpp)
gradapt_add_test(test_train_device_path GROUP core SOURCES test_train_device_path.cpp)
# comm::nccl's own code on host threads through the stand-in for NCCL and the CUDA runtime in
# support/fake_nccl (first on this test's include path, so its own executable; LIBS keeps it off
# the shared precompiled header, which is built with the ordinary include path).
gradapt_add_test(test_nccl_host SOURCES test_nccl_host.cpp LIBS Threads::Threads)
target_include_directories(test_nccl_host BEFORE PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/support/fake_nccl)
# One rank's different option is an error on every rank naming it: bucket reducer, hierarchy,
# sharded optimizer.
gradapt_add_test(test_option_agreement GROUP core SOURCES test_option_agreement.cpp)
# Ranks that disagree: every rank throws, none hangs (bounded by the threads watchdog).
gradapt_add_test(test_disagreement GROUP core SOURCES test_disagreement.cpp)
# 10,000 random cases of ranks that call different collectives, types, ops, counts or options.
gradapt_add_test(test_soak_disagreement GROUP core SOURCES test_soak_disagreement.cpp)
# A backend defined in the test from the documented concepts only, against gradapt::host.
gradapt_add_test(test_backend_third_party GROUP core SOURCES test_backend_third_party.cpp)
# A combine policy and a stateful hook defined in the test, through the documented contract.
gradapt_add_test(test_train_policy GROUP core SOURCES test_train_policy.cpp)
gradapt_add_test(test_optim_adafactor GROUP optim SOURCES test_optim_adafactor.cpp)
gradapt_add_test(test_optim_factored_chain GROUP optim SOURCES test_optim_factored_chain.cpp)
gradapt_add_test(test_optim_factored_refs GROUP optim SOURCES test_optim_factored_refs.cpp)
gradapt_add_test(test_factored_backend GROUP optim SOURCES test_factored_backend.cpp)
gradapt_add_test(test_optim_sm3 GROUP optim SOURCES test_optim_sm3.cpp)
gradapt_add_test(test_archive GROUP core SOURCES test_archive.cpp)
gradapt_add_test(test_checkpoint_bitflip GROUP core SOURCES test_checkpoint_bitflip.cpp)
# The linear-algebra component (BLAS/LAPACK through gradapt::linalg): products, the symmetric
# eigensolver and inverse p-th roots.
if(GRADAPT_WITH_LAPACK)
  gradapt_add_test(test_linalg GROUP linalg SOURCES test_linalg.cpp LIBS gradapt::linalg)
  gradapt_add_test(test_linalg_root GROUP linalg SOURCES test_linalg_root.cpp LIBS gradapt::linalg)
  # Shampoo (optim/shampoo.hpp) on gradapt::host with host_lapack.
  gradapt_add_test(test_shampoo GROUP linalg SOURCES test_shampoo.cpp LIBS gradapt::linalg)
  # Shampoo against DistributedShampoo trajectories (tests/data/shampoo, make_shampoo_refs.py).
  gradapt_add_test(test_shampoo_refs GROUP linalg SOURCES test_shampoo_refs.cpp LIBS gradapt::linalg)
  # Its matrices are at most 288 x 288: BLAS threads only add contention.
  if(TEST test_shampoo_refs)  # not registered in the tsan preset (it starts no threads)
    set_tests_properties(test_shampoo_refs PROPERTIES ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endif()
  # Shampoo's roots over comm::threads ranks and in its background thread.
  gradapt_add_test(test_shampoo_dist GROUP linalg SOURCES test_shampoo_dist.cpp LIBS gradapt::linalg)
  # Shampoo's spectral descent on device memory through the device-tagged host backends.
  gradapt_add_test(test_shampoo_device_path GROUP linalg SOURCES test_shampoo_device_path.cpp
                   support/shampoo_ld_reference.cpp LIBS gradapt::linalg)
  if(TEST test_shampoo_device_path)  # rank threads each run BLAS: its own threads only add contention
    set_tests_properties(test_shampoo_device_path PROPERTIES ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endif()
  # K-FAC (optim/kfac.hpp): closed forms, long double references, comm::threads ranks.
  gradapt_add_test(test_kfac GROUP linalg SOURCES test_kfac.cpp LIBS gradapt::linalg)
  # K-FAC against kfac-pytorch's reference data (tests/data/make_kfac_refs.py).
  gradapt_add_test(test_kfac_refs GROUP linalg SOURCES test_kfac_refs.cpp LIBS gradapt::linalg)
  # K-FAC in the precondition slot of train::data_parallel_step (train/kfac_policy.hpp).
  gradapt_add_test(test_train_kfac GROUP linalg SOURCES test_train_kfac.cpp LIBS gradapt::linalg)
  # K-FAC with its state in device memory, through the device-tagged host backends.
  gradapt_add_test(test_kfac_device_path GROUP linalg SOURCES test_kfac_device_path.cpp
                   support/kfac_ld_reference.cpp LIBS gradapt::linalg)
  # The Shampoo family in train::data_parallel_step: every state, reduce and combine slot, the
  # scaler, AdaScale, LocalSGD, the roots over the ranks, an N -> M restore (comm::threads ranks).
  gradapt_add_test(test_train_shampoo GROUP linalg SOURCES test_train_shampoo.cpp LIBS gradapt::linalg)
  if(TEST test_train_shampoo)  # rank threads each run BLAS: its own threads only add contention
    set_tests_properties(test_train_shampoo PROPERTIES ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endif()
  # The Shampoo family in the sharded optimizer, sharded by block (comm::threads ranks).
  gradapt_add_test(test_shard_shampoo GROUP linalg SOURCES test_shard_shampoo.cpp LIBS gradapt::linalg)
  if(TEST test_shard_shampoo)  # rank threads each run BLAS: its own threads only add contention
    set_tests_properties(test_shard_shampoo PROPERTIES ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
  endif()
  # A randomized soak of one disagreeing rank over the composed step's slots, Shampoo, K-FAC and
  # elastic jobs (comm::threads).
  gradapt_add_test(test_soak_surfaces GROUP linalg SOURCES test_soak_surfaces.cpp LIBS gradapt::linalg)
endif()
# cuda_linalg (cuBLAS + cuSOLVER) on the device: compiled with the CUDA tests' runner, skipped
# at run time without a GPU (exit code 77).
if(GRADAPT_WITH_CUDA)
  add_executable(test_linalg_cuda test_linalg_cuda.cu support/shampoo_ld_reference.cpp
                 support/kfac_ld_reference.cpp)
  target_link_libraries(test_linalg_cuda PRIVATE gradapt::cuda_linalg gradapt_cuda_test_main)
  if(GRADAPT_WARNINGS_AS_ERRORS)
    set(_linalg_cuda_flags -Xcompiler=-Wall,-Wextra,-Werror --Werror=all-warnings)
  else()
    set(_linalg_cuda_flags -Xcompiler=-Wall,-Wextra)
  endif()
  target_compile_options(test_linalg_cuda PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:${_linalg_cuda_flags}>")
  add_test(NAME test_linalg_cuda COMMAND test_linalg_cuda)
  set_tests_properties(test_linalg_cuda PROPERTIES SKIP_RETURN_CODE 77 LABELS cuda)
endif()
