# cmake -DBIN=<fdctl> [-DLINK_FILE=<build.ninja | link.txt>] -P link_check.cmake
# fdctl links the publisher library, never the engine (ARCHITECTURE.md: publish/ links no fd_core):
#  1. its link command (build.ninja's or CMakeFiles/fdctl.dir/link.txt) names no libfd_core.a /
#     libfd_kernels.a;
#  2. the binary defines no symbol of the engine's namespaces (nm -C): fd::engine, fd::runtime,
#     fd::kernels, fd::api, fd::kv, fd::tokenizer, fd::control, and no fd::model::Worker.
# A check that cannot fail is a defect: run with BIN=<fdrollout> it must report the
# engine symbols of the daemon (CTest fdctl_links_no_engine_selftest, WILL_FAIL).
if(NOT BIN)
  message(FATAL_ERROR "link_check: pass -DBIN=<binary>")
endif()
set(bad "")
if(LINK_FILE AND EXISTS "${LINK_FILE}")
  file(READ "${LINK_FILE}" text)
  # build.ninja: the link edge of this binary only.
  get_filename_component(bin_name "${BIN}" NAME)
  string(REGEX MATCH "build ${bin_name}: CXX_EXECUTABLE_LINKER[^\n]*" edge "${text}")
  if(edge STREQUAL "")
    set(edge "${text}")  # link.txt holds one command
  endif()
  foreach(lib libfd_core.a libfd_kernels.a)
    string(FIND "${edge}" "${lib}" at)
    if(NOT at EQUAL -1)
      string(APPEND bad "link line names ${lib}\n")
    endif()
  endforeach()
endif()
# nm | grep in one pipe (CMake's own regex over a daemon's symbol table takes minutes).
execute_process(COMMAND nm -C --defined-only "${BIN}"
                COMMAND grep -E "fd::(engine|runtime|kernels|api|kv|tokenizer|control)::|fd::model::Worker"
                OUTPUT_VARIABLE hits RESULTS_VARIABLE rc)  # rc: one exit code per command
list(GET rc 0 nm_rc)
if(NOT nm_rc EQUAL 0)
  message(FATAL_ERROR "link_check: nm ${BIN} failed (${rc})")
endif()
if(NOT hits STREQUAL "")
  string(REGEX MATCHALL "[^\n]+" lines "${hits}")
  list(LENGTH lines n)
  list(SUBLIST lines 0 5 first)
  string(REPLACE ";" "\n  " first "${first}")
  string(APPEND bad "${n} engine symbols defined in ${BIN}, e.g.\n  ${first}\n")
endif()
if(NOT bad STREQUAL "")
  message(FATAL_ERROR "link_check FAILED for ${BIN}:\n${bad}")
endif()
message(STATUS "link_check: ${BIN} has no engine (fd_core / fd_kernels) code")
