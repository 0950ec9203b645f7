# Fails when a doctest case name holds a ';' or a '[' with no ']' after it: CTest's discovery
# splits names at ';' (a CMake list separator), and each half then selects no case, so the case
# would pass without running; an unclosed '[' breaks the discovery's list for the whole binary.
file(GLOB_RECURSE sources "${SOURCE_DIR}/tests/*.cpp")
set(bad "")
foreach(source IN LISTS sources)
  file(STRINGS "${source}" lines REGEX "_CASE\\(\"[^\"]*;")
  file(STRINGS "${source}" unclosed REGEX "_CASE\\(\"[^\"]*\\[[^]\"]*\"")
  foreach(line IN LISTS lines unclosed)
    string(APPEND bad "\n  ${source}: ${line}")
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "test case names with ';' or an unclosed '[' (CTest would split them):${bad}")
endif()
