# ctest script: the CMake path that ports/gradapt/portfile.cmake drives, without the vcpkg tool
# (which cannot be installed here). It reads the -D options of the portfile's
# vcpkg_cmake_configure call, configures this source tree with them, installs into a scratch
# prefix laid out as vcpkg lays out a port (share/<port>/ for the config, the usage file and
# the copyright), checks that layout, and builds and runs a consumer that follows the usage
# file's instructions against that prefix.
#
#   cmake -DSRC=<source> -DWORK=<scratch> -DGEN=<generator> -DCXX=<compiler> -P vcpkg_port_layout.cmake
file(REMOVE_RECURSE ${WORK})
set(port ${SRC}/ports/gradapt)

# 1. The portfile's configure options (one -D per line between OPTIONS and the closing paren).
file(READ ${port}/portfile.cmake portfile)
string(REGEX MATCH "vcpkg_cmake_configure\\(([^)]*)\\)" _ "${portfile}")
set(call "${CMAKE_MATCH_1}")
string(REGEX MATCHALL "-D[A-Za-z0-9_]+=[^ \t\r\n]+" options "${call}")
list(LENGTH options n)
if(n LESS 5)
  message(FATAL_ERROR "found only ${n} -D options in the portfile's vcpkg_cmake_configure: ${options}")
endif()
foreach(o IN LISTS options)
  if(o MATCHES "GRADAPT_INSTALL_CMAKEDIR=(.*)")
    set(cmakedir "${CMAKE_MATCH_1}")
  endif()
endforeach()
if(NOT cmakedir STREQUAL "share/gradapt")
  message(FATAL_ERROR "the portfile must install the config into share/gradapt (vcpkg's layout), not '${cmakedir}'")
endif()
message(STATUS "portfile options: ${options}")

# 2. Configure (release only, as VCPKG_BUILD_TYPE release) and install.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC} -B ${WORK}/build -G ${GEN} -DCMAKE_BUILD_TYPE=Release
                        -DCMAKE_CXX_COMPILER=${CXX} ${options} RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "configure with the portfile's options failed: ${r}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WORK}/build --prefix ${WORK}/installed RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "install failed: ${r}")
endif()
# What the portfile does after vcpkg_cmake_install.
set(pkg ${WORK}/installed)
file(REMOVE_RECURSE ${pkg}/debug ${pkg}/lib ${pkg}/share/doc)
file(INSTALL ${port}/usage DESTINATION ${pkg}/share/gradapt)
file(INSTALL ${SRC}/LICENSE DESTINATION ${pkg}/share/gradapt)
file(RENAME ${pkg}/share/gradapt/LICENSE ${pkg}/share/gradapt/copyright)

# 3. The layout vcpkg expects of a header-only port.
foreach(f include/gradapt/gradapt.hpp share/gradapt/gradaptConfig.cmake share/gradapt/gradaptConfigVersion.cmake
          share/gradapt/gradaptTargets.cmake share/gradapt/gradaptComponents.cmake share/gradapt/usage
          share/gradapt/copyright share/pkgconfig/gradapt.pc)
  if(NOT EXISTS ${pkg}/${f})
    message(FATAL_ERROR "missing ${f} in the port's install tree")
  endif()
endforeach()
file(GLOB_RECURSE binaries ${pkg}/*.a ${pkg}/*.so ${pkg}/*.lib ${pkg}/*.dll)
if(binaries)
  message(FATAL_ERROR "a header-only port installs no binaries, found: ${binaries}")
endif()
if(EXISTS ${pkg}/share/cmake)
  message(FATAL_ERROR "config files left in share/cmake: vcpkg_cmake_config_fixup would have to move them")
endif()
# Paths in the config must be relative to the prefix (vcpkg relocates installed trees).
file(GLOB cfgs ${pkg}/share/gradapt/*.cmake)
foreach(c IN LISTS cfgs)
  file(READ ${c} text)
  string(FIND "${text}" "${WORK}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "${c} contains the absolute install path ${WORK}: not relocatable")
  endif()
endforeach()

# 4. A consumer that follows the usage file, against a relocated copy of the tree.
file(READ ${pkg}/share/gradapt/usage usage)
if(NOT usage MATCHES "find_package\\(gradapt CONFIG REQUIRED\\)" OR NOT usage MATCHES "gradapt::gradapt")
  message(FATAL_ERROR "the usage file does not show find_package(gradapt CONFIG REQUIRED) and gradapt::gradapt")
endif()
file(COPY ${pkg}/ DESTINATION ${WORK}/relocated)
file(MAKE_DIRECTORY ${WORK}/consumer)
file(WRITE ${WORK}/consumer/CMakeLists.txt
  "cmake_minimum_required(VERSION 3.25)\nproject(vcpkg_consumer CXX)\n"
  "find_package(gradapt CONFIG REQUIRED)\nfind_package(Threads REQUIRED)\n"
  "add_executable(main main.cpp)\ntarget_link_libraries(main PRIVATE gradapt::gradapt Threads::Threads)\n")
file(WRITE ${WORK}/consumer/main.cpp
  "#include <gradapt/gradapt.hpp>\n#include <vector>\n"
  "int main() {\n  std::vector<float> x{3.0f, 4.0f};\n"
  "  return gradapt::host{.threads = 1}.reduce(gradapt::reduction::sum_squares, gradapt::host_view(x)) == 25.0 ? 0 : 1;\n}\n")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK}/consumer -B ${WORK}/consumer/build -G ${GEN}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/relocated RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer configure against the relocated port tree failed: ${r}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/consumer/build RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer build failed: ${r}")
endif()
execute_process(COMMAND ${WORK}/consumer/build/main RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer run failed: ${r}")
endif()
message(STATUS "vcpkg port layout: ok")
