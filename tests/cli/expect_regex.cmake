# Runs BIN with ARGS and checks both the exit code (CODE, default 0) and that
# stdout+stderr match the regular expression REGEX. Unlike ctest's
# PASS_REGULAR_EXPRESSION, which ignores the exit code, a command that prints the
# right text and then fails does not pass.
if(NOT DEFINED CODE)
  set(CODE 0)
endif()
# stdout and stderr into one variable, in the order written (as ctest would show them).
execute_process(COMMAND ${BIN} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT "${rc}" STREQUAL "${CODE}")
  message(FATAL_ERROR "exit code ${rc}, expected ${CODE}\noutput: ${out}")
endif()
if(NOT "${out}" MATCHES "${REGEX}")
  message(FATAL_ERROR "output does not match the expected pattern\npattern: ${REGEX}\noutput: ${out}")
endif()
