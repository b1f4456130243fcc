# Zero-copy adapters (include/gradapt/adapters/): each test is built only when its library is
# found, so a machine without Eigen, xtensor, LibTorch or Thrust still builds the rest.

# Eigen 3.3+ (Debian: libeigen3-dev).
find_package(Eigen3 3.3 QUIET NO_MODULE)
if(TARGET Eigen3::Eigen)
  gradapt_add_test(test_adapter_eigen SOURCES test_adapter_eigen.cpp LIBS Eigen3::Eigen)
endif()

# xtensor (Debian: libxtensor-dev, which brings xtl).
find_package(xtensor QUIET)
if(TARGET xtensor)
  gradapt_add_test(test_adapter_xtensor SOURCES test_adapter_xtensor.cpp LIBS xtensor)
endif()

# Thrust on the host: the CUDA toolkit's CCCL headers (or a standalone Thrust) compiled by the
# host compiler with the sequential (CPP) device system, so device_vector holds host memory.
# No nvcc or GPU needed; the CUDA-system mapping is tested in tests/cuda.
find_path(GRADAPT_THRUST_INCLUDE thrust/version.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_INCLUDE_DIRS}/cccl
  PATHS /usr/local/cuda/include/cccl /usr/local/cuda/include)
if(GRADAPT_THRUST_INCLUDE)
  gradapt_add_test(test_adapter_thrust SOURCES test_adapter_thrust.cpp)
  target_include_directories(test_adapter_thrust SYSTEM PRIVATE ${GRADAPT_THRUST_INCLUDE})
  target_compile_definitions(test_adapter_thrust PRIVATE THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP)
endif()

# LibTorch (Debian: libtorch-dev 1.13 ships TorchConfig.cmake under
# /usr/lib/<multiarch>/cmake/Torch, found through the default prefix).
find_package(Torch QUIET)
# Debian's LibTorch 1.13 headers do not compile as C++20 with Clang (std::vector<c10::IValue>
# of an incomplete type, instantiated eagerly); the LibTorch targets need GCC there.
if(TARGET torch AND CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(STATUS "gradapt: LibTorch adapter tests skipped: LibTorch's headers do not compile as C++20 with Clang")
elseif(TARGET torch)
  foreach(_t test_adapter_torch test_adapter_torch_module)
    gradapt_add_test(${_t} SOURCES ${_t}.cpp LIBS ${TORCH_LIBRARIES})
    set_tests_properties(${_t} PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=1")
  endforeach()
endif()
