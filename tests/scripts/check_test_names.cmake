# Fails when a doctest case name holds a ';' or a '[' with no ']' after it: CTest's discovery
# splits names at ';' (a CMake list separator), and each half then selects no case, so the case
# would pass without running; an unclosed '[' breaks the discovery's list for the whole binary.
# A name may begin on the line after its macro's parenthesis.
file(GLOB_RECURSE sources "${SOURCE_DIR}/tests/*.cpp")
set(bad "")
foreach(source IN LISTS sources)
  file(READ "${source}" content)
  string(REGEX MATCHALL "_CASE\\([ \t\r\n]*\"[^\";]*;" semicolons "${content}")
  string(REGEX MATCHALL "_CASE\\([ \t\r\n]*\"[^\"]*\\[[^]\"]*\"" unclosed "${content}")
  if(semicolons OR unclosed)
    string(REGEX REPLACE "[\r\n]+[ \t]*" " " found "${semicolons} ${unclosed}")
    string(APPEND bad "\n  ${source}: ${found}")
  endif()
endforeach()
if(bad)
  message(FATAL_ERROR "test case names with ';' or an unclosed '[' (CTest would split them):${bad}")
endif()
