# Fails when a binary of both backends' cases (kda_add_test MATRIX) holds a case whose name ends
# in neither "[cpu]" nor "[cuda]": CTest registers those binaries' cases by that tag, so such a
# case would never run. BINARIES: the binaries' paths, separated by '|'.
string(REPLACE "|" ";" binaries "${BINARIES}")
set(bad "")
foreach(binary IN LISTS binaries)
  execute_process(COMMAND "${binary}" --list-test-cases --no-version
                  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${binary} --list-test-cases failed (${rc}): ${errors}")
  endif()
  string(REPLACE "\n" ";" lines "${listing}")
  foreach(line IN LISTS lines)
    if(line STREQUAL "" OR line MATCHES "^\\[doctest\\]" OR line MATCHES "^=+$")
      continue()
    endif()
    if(NOT line MATCHES "\\[(cpu|cuda)\\]$")
      get_filename_component(name "${binary}" NAME)
      string(APPEND bad "\n  ${name}: ${line}")
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "cases of two-backend binaries without a [cpu] or [cuda] tag (CTest would "
                      "never run them):${bad}")
endif()
