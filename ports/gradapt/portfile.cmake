# vcpkg overlay port for gradapt, built from the checkout that contains it:
#   vcpkg install gradapt[mpi] --overlay-ports=<gradapt checkout>/ports
# A registry port would fetch a release instead (vcpkg_from_github with REF and SHA512); the
# configure, install and fixup steps below stay the same. The ctest vcpkg_port_layout runs
# this configure with the OPTIONS written here and checks the installed layout.

# Header-only: one (release) configuration, nothing to compile.
set(VCPKG_BUILD_TYPE release)
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../..")

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    mpi  GRADAPT_WITH_MPI
    cuda GRADAPT_WITH_CUDA
    nccl GRADAPT_WITH_NCCL
    linalg GRADAPT_WITH_LAPACK
)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DGRADAPT_BUILD_TESTS=OFF
    -DGRADAPT_BUILD_EXAMPLES=OFF
    -DGRADAPT_BUILD_BENCH=OFF
    -DGRADAPT_BUILD_DOCS=OFF
    -DGRADAPT_INSTALL=ON
    -DGRADAPT_WITH_OPENMP=OFF
    -DGRADAPT_INSTALL_CMAKEDIR=share/gradapt
    ${FEATURE_OPTIONS}
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH share/gradapt)
vcpkg_fixup_pkgconfig()

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/lib" "${CURRENT_PACKAGES_DIR}/share/doc")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
