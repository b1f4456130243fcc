"""Conan 2 recipe for gradapt, a header-only C++20 library.

The package carries gradapt's own CMake package config (share/cmake/gradapt), so consumers use
find_package(gradapt CONFIG REQUIRED COMPONENTS ...) exactly as with a plain CMake install;
the optional engines (MPI, CUDA, NCCL, OpenMP, BLAS/LAPACK) come from the system, found by that config.
The options say which engines the package is checked against when it is created: with an
option on, `conan create` configures gradapt with that engine required, and test_package
builds a consumer that links the matching gradapt:: component.
"""
import os
import re

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import load


class GradaptConan(ConanFile):
    name = "gradapt"
    description = "Header-only C++20 adaptation algorithms for distributed training"
    license = "MIT"
    topics = ("distributed-training", "header-only", "mpi", "nccl", "cuda")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {
        "with_mpi": [True, False],
        "with_cuda": [True, False],
        "with_nccl": [True, False],
        "with_linalg": [True, False],
    }
    default_options = {"with_mpi": False, "with_cuda": False, "with_nccl": False, "with_linalg": False}
    exports_sources = "CMakeLists.txt", "LICENSE", "cmake/*", "include/*"
    no_copy_source = True

    def set_version(self):
        text = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        self.version = re.search(r"project\(gradapt VERSION ([0-9.]+)", text).group(1)

    def validate(self):
        check_min_cppstd(self, 20)
        if self.options.with_nccl and not self.options.with_cuda:
            from conan.errors import ConanInvalidConfiguration

            raise ConanInvalidConfiguration("gradapt: with_nccl needs with_cuda")

    def layout(self):
        cmake_layout(self)

    def generate(self):
        tc = CMakeToolchain(self)
        tc.cache_variables["GRADAPT_BUILD_TESTS"] = False
        tc.cache_variables["GRADAPT_BUILD_EXAMPLES"] = False
        tc.cache_variables["GRADAPT_BUILD_BENCH"] = False
        tc.cache_variables["GRADAPT_BUILD_DOCS"] = False
        tc.cache_variables["GRADAPT_INSTALL"] = True
        tc.cache_variables["GRADAPT_WITH_MPI"] = bool(self.options.with_mpi)
        tc.cache_variables["GRADAPT_WITH_CUDA"] = bool(self.options.with_cuda)
        tc.cache_variables["GRADAPT_WITH_NCCL"] = bool(self.options.with_nccl)
        tc.cache_variables["GRADAPT_WITH_LAPACK"] = bool(self.options.with_linalg)
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        cmake = CMake(self)
        cmake.install()

    def package_id(self):
        # Header-only: one package whatever the settings; the options stay in the id because
        # they record which engines the package was checked against.
        self.info.settings.clear()

    def package_info(self):
        # Consumers find gradapt through its own config file, not a generated one.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.set_property("cmake_file_name", "gradapt")
        self.cpp_info.builddirs.append(os.path.join("share", "cmake", "gradapt"))
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
