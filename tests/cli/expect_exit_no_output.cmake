# expect_exit.cmake (BIN, ARGS, CODE, EXPECT), and afterwards the folder ABSENT must
# not exist: a command that fails writes nothing.
file(REMOVE_RECURSE "${ABSENT}")
include(${CMAKE_CURRENT_LIST_DIR}/expect_exit.cmake)
if(EXISTS "${ABSENT}")
  message(FATAL_ERROR "'${ABSENT}' was created although the command failed")
endif()
