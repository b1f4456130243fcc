# Defines gradapt::<component> as an INTERFACE IMPORTED GLOBAL target that adds the
# component's dependency to `base` (gradapt::gradapt). Used by the build tree and by the
# installed gradaptConfig.cmake, so add_subdirectory, FetchContent and find_package users
# get the same targets. Components: openmp, mpi, cuda, nccl, linalg (BLAS + LAPACK; the
# consumer's BLA_VENDOR picks the implementation), cuda_linalg (cuBLAS + cuSOLVER).
include_guard(GLOBAL)
include(CMakeFindDependencyMacro)

macro(_gradapt_find_dep)
  if(_gradapt_in_config)
    find_dependency(${ARGN})
  else()
    find_package(${ARGN} REQUIRED)
  endif()
endmacro()

function(gradapt_add_component comp base)
  if(TARGET gradapt::${comp})
    return()
  endif()
  if(comp STREQUAL "openmp")
    _gradapt_find_dep(OpenMP COMPONENTS CXX)
    set(_deps OpenMP::OpenMP_CXX)
  elseif(comp STREQUAL "mpi")
    _gradapt_find_dep(MPI COMPONENTS CXX)
    set(_deps MPI::MPI_CXX)
  elseif(comp STREQUAL "cuda")
    _gradapt_find_dep(CUDAToolkit)
    set(_deps CUDA::cudart)
  elseif(comp STREQUAL "nccl")
    gradapt_add_component(cuda ${base})
    _gradapt_find_dep(NCCL)
    set(_deps gradapt::cuda NCCL::nccl)
  elseif(comp STREQUAL "linalg")
    _gradapt_find_dep(LAPACK)
    set(_deps LAPACK::LAPACK)
  elseif(comp STREQUAL "cuda_linalg")
    gradapt_add_component(cuda ${base})
    set(_deps gradapt::cuda CUDA::cublas CUDA::cusolver)
  else()
    message(FATAL_ERROR "gradapt: unknown component '${comp}' (expected openmp, mpi, cuda, nccl, linalg or cuda_linalg)")
  endif()
  add_library(gradapt::${comp} INTERFACE IMPORTED GLOBAL)
  target_link_libraries(gradapt::${comp} INTERFACE ${base} ${_deps})
  if(comp STREQUAL "cuda")
    # gradapt needs C++20 in .cu files too. CMake 3.25 does not know that nvcc 12+ accepts it
    # (cuda_std_20 fails there), so the flag is passed directly; --extended-lambda lets users
    # write GRADAPT_HD lambdas as element functors.
    target_compile_options(gradapt::${comp} INTERFACE
      $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 --extended-lambda>)
  endif()
  if(comp STREQUAL "cuda_linalg")
    # cuda_linalg's shape checks call tensor_view::dim (GRADAPT_HD, std::array::operator[]) from
    # host code in a .cu unit; nvcc needs this flag for it.
    target_compile_options(gradapt::${comp} INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  endif()
endfunction()
