# cmake -DCXX=<compiler> -DSOURCE=<file.cpp> -DINCLUDE=<include dir> -P check.cmake
# Compiles SOURCE with -fsyntax-only and passes when the compile fails and its output holds
# every text that follows "// expect: " in SOURCE (each a static_assert message of the library).
file(STRINGS "${SOURCE}" _expect REGEX "^// expect: ")
if(NOT _expect)
  message(FATAL_ERROR "${SOURCE}: no '// expect:' line")
endif()
execute_process(COMMAND "${CXX}" -std=c++20 -fsyntax-only -I${INCLUDE} "${SOURCE}"
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(_rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but every combination in it must be rejected")
endif()
string(REGEX REPLACE "[\r\n]+" " " _flat "${_out}")
foreach(_line ${_expect})
  string(REGEX REPLACE "^// expect: " "" _text "${_line}")
  string(FIND "${_flat}" "${_text}" _at)
  if(_at EQUAL -1)
    message(FATAL_ERROR "${SOURCE}: the compiler's output does not hold \"${_text}\":\n${_out}")
  endif()
endforeach()
list(LENGTH _expect _n)
message(STATUS "${SOURCE}: rejected, with all ${_n} expected messages")
