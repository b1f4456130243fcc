import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout


class GradaptTestConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeDeps"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        tc = CMakeToolchain(self)
        opts = self.dependencies["gradapt"].options
        comps = [
            c
            for c, on in (
                ("mpi", opts.with_mpi),
                ("cuda", opts.with_cuda),
                ("nccl", opts.with_nccl),
                ("linalg", opts.with_linalg),
            )
            if on
        ]
        tc.cache_variables["GRADAPT_TEST_COMPONENTS"] = ";".join(comps)
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "gradapt_test_package"), env="conanrun")
